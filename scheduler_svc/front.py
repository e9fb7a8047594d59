"""The serving front: the one door of the servicer and the worker link, for 1 to N workers.

Each worker gets a lane: a Scheduler of its own (its KV pool, waiting queue and running
set) turned by its own StepLoop, so each keeps one worker's semantics (overlapped steps,
isolation, the grace period); the lanes' loops run concurrently as asyncio tasks over the
one WorkerLink endpoint. With one worker there is one lane. The front owns what the lanes
share, so a request's stream and text follow it from lane to lane:
- the output slots (OutputStreams) and the text states (each lane's OutputProcessor reads
  and writes the one dict); a request id is refused while any lane holds it;
- admission: `submit` adds the request to the Scheduler of the lane placement.choose_lane
  picks (prefix-cache affinity among the lanes whose KV use, counting queued demand, is
  within affinity_max_kv_use_gap of the least; then least KV use; then fewer running),
  then opens its text state and its slot;
- availability (no worker yet, draining, past the grace period without one) and drain;
- cancels and releases, sent to the lane that holds the request;
- attaches and detaches (WorkerEvents): an attaching worker gets the lane left without a
  worker if there is one, else a new lane; a lost worker's lane hands its requests over
  to the lanes that still have a worker, with the tokens they streamed (nothing a client
  received is lost or repeated), and closes; the last lane keeps them for the grace
  period and the next worker, as one worker does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagoda.protos import step_pb2
from pagoda.scheduler_svc.core import (
    DuplicateRequestError,
    FinishReason,
    RequestOutput,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
    TenantStats,
    ValidRequest,
)
from pagoda.scheduler_svc.core.kv import cache_root_hash
from pagoda.scheduler_svc.core.placement import choose_lane
from pagoda.scheduler_svc.core.request import Request, sample_request_ids, token_array
from pagoda.scheduler_svc.detokenizer import IncrementalDetokenizer
from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.output_processor import OutputProcessor, TextState
from pagoda.scheduler_svc.output_streams import (
    MAX_UNREAD_TOKENS,
    OutputSlot,
    OutputStreams,
    unread_message,
)
from pagoda.scheduler_svc.step_loop import IDLE_TICK_S, LoopSettings, StepLoop
from pagoda.scheduler_svc.worker_link import WorkerInfo, WorkerLink, WorkerLost
from pagoda.scheduler_svc.worker_stats import WorkerStats

log = logging.getLogger("pagoda.front")

# After the drain timeout, how long cancelled streams get to see their last output.
CANCEL_PUBLISH_S = 2.0

# Counters of a closed lane that the totals keep (its gauges leave with it).
_CUMULATIVE_STATS = (
    "num_preemptions",
    "num_steps",
    "num_isolated_steps",
    "num_requests_finished",
    "num_generated_tokens",
    "num_prefix_queries_tokens",
    "num_prefix_hit_tokens",
    "num_draft_tokens",
    "num_accepted_draft_tokens",
)
_TENANT_COUNTS = tuple(f.name for f in dataclasses.fields(TenantStats) if f.name != "tenant")


class Unavailable(Exception):
    """No worker can serve a new request now (none attached, or draining); a sentence."""


@dataclass(slots=True, eq=False)
class _Lane:
    number: int  # for logs: lanes are numbered from 1 as they open
    scheduler: Scheduler
    # Its own, for its own cursor over its steps' columns; the text states are shared.
    processor: OutputProcessor
    loop: StepLoop
    # The worker given to this lane (set at the link's attach, before its loop takes
    # it): None once the link reported it lost.
    identity: bytes | None = None
    task: asyncio.Task | None = None


class _LaneLink:
    """A lane's view of the shared link: its steps go to its own worker."""

    def __init__(self, link: WorkerLink, identity: Callable[[], bytes | None]) -> None:
        self._link = link
        self._identity = identity

    def start_step(
        self, plan: step_pb2.StepPlan, timeout_s: float
    ) -> asyncio.Future[step_pb2.StepResult]:
        identity = self._identity()
        if identity is None:
            gone = asyncio.get_running_loop().create_future()
            gone.set_exception(WorkerLost("the lane's worker is gone"))
            return gone
        return self._link.start_step(plan, timeout_s, identity)

    def send_masks(self, masks: step_pb2.StepMasks) -> None:
        identity = self._identity()
        if identity is not None:
            self._link.send_masks(masks, identity)

    def heard_within(self, seconds: float) -> bool:
        identity = self._identity()
        return identity is not None and self._link.heard_within(seconds, identity)


class Front:
    def __init__(
        self,
        config: SchedulerConfig,
        link: WorkerLink,
        metrics: Metrics,
        *,
        detokenizer_factory: Callable[[], IncrementalDetokenizer],
        worker_timeout_s: float,
        worker_grace_s: float,
        status_interval_s: float,
        on_worker_change: Callable[[bool], None] = lambda attached: None,
        clock: Callable[[], float] = time.monotonic,
        idle_tick_s: float = IDLE_TICK_S,
        overlap_steps: bool | None = None,
        late_plan_ahead: bool = True,
    ) -> None:
        """`on_worker_change`: told when the front starts serving (a first worker is
        attached) or stops (the last one left)."""
        self._config = config
        self._link = link
        self._metrics = metrics
        self._detokenizer_factory = detokenizer_factory
        # Every unfinished request's text state, shared by the lanes' output processors so
        # that it follows a request handed over from lane to lane.
        self._texts: dict[str, TextState] = {}
        # A client that stops reading has its request ended, not its output piled up.
        self._streams = OutputStreams(
            on_overflow=lambda request_id: self.cancel(
                request_id, FinishReason.ERROR, unread_message(MAX_UNREAD_TOKENS)
            )
        )
        self._settings = LoopSettings(
            worker_timeout_s=worker_timeout_s,
            worker_grace_s=worker_grace_s,
            status_interval_s=status_interval_s,
            idle_tick_s=idle_tick_s,
            overlap_steps=overlap_steps,
            late_plan_ahead=late_plan_ahead,
        )
        self._on_worker_change = on_worker_change
        self._clock = clock
        self._lanes: list[_Lane] = []
        self._num_lanes_opened = 0
        self._tasks: set[asyncio.Task] = set()  # every lane's loop, closed ones until done
        self._changed = asyncio.Event()
        # Cancels asked for and perhaps not yet taken by a lane's loop: sent again to the
        # lane a handed-over request moves to.
        self._cancels: dict[str, tuple[FinishReason, str | None]] = {}
        self._closed_stats = dict.fromkeys(_CUMULATIVE_STATS, 0)
        self._serving = False
        self._ever_attached = False
        self._lost_at_s: float | None = None
        self._draining = False
        self._stopped = False

    # -- for the servicer (same event loop) --------------------------------------------------

    @property
    def worker(self) -> WorkerInfo | None:
        """The first lane's worker, None while no lane has one."""
        return next((lane.loop.worker for lane in self._lanes if lane.loop.worker), None)

    @property
    def stats(self) -> SchedulerStats:
        """The lanes' figures added up (closed lanes' counters included)."""
        per_lane = [lane.scheduler.stats for lane in self._lanes]
        if len(per_lane) == 1 and not any(self._closed_stats.values()):
            return per_lane[0]
        totals: dict[str, Any] = {}
        for field in dataclasses.fields(SchedulerStats):
            values = [getattr(stats, field.name) for stats in per_lane]
            if field.type in (int, "int") and not field.name.startswith("step_"):
                totals[field.name] = sum(values) + self._closed_stats.get(field.name, 0)
            else:  # rates, the step budget's cap and model: the first lane's
                totals[field.name] = values[0] if values else 0
        queried = totals["num_prefix_queries_tokens"]
        totals["prefix_cache_hit_rate"] = (
            totals["num_prefix_hit_tokens"] / queried if queried else 0.0
        )
        return SchedulerStats(**totals)

    def worker_stats(self) -> list[WorkerStats]:
        return [stats for lane in self._lanes for stats in lane.loop.worker_stats()]

    def tenant_stats(self) -> list[TenantStats]:
        """Each tenant's figures, the open lanes' added up (a closed lane's are gone)."""
        totals: dict[str, dict[str, int]] = {}
        for lane in self._lanes:
            for stats in lane.scheduler.tenant_stats():
                total = totals.setdefault(stats.tenant, dict.fromkeys(_TENANT_COUNTS, 0))
                for name in _TENANT_COUNTS:
                    total[name] += getattr(stats, name)
        return [TenantStats(tenant=name, **totals[name]) for name in sorted(totals)]

    @property
    def draining(self) -> bool:
        return self._draining

    def submit(self, request: ValidRequest) -> OutputSlot:
        """Queue a validated request of one sample on a lane and open its output slot;
        `release` it when done reading.

        Raises Unavailable, or the scheduler's QueueFullError / RequestTooLargeError /
        DuplicateRequestError.
        """
        if request.n != 1:
            raise ValueError("submit() takes one sample; submit_samples() takes n")
        return self.submit_samples(request)[0]

    def submit_samples(self, request: ValidRequest) -> list[OutputSlot]:
        """Queue a validated request's n samples on one lane (they share the prompt's
        blocks there) and open their output slots, in index order (the ids of
        sample_request_ids); `release` each when done reading. Raises as submit()."""
        self._check_available()
        request_ids = sample_request_ids(request.request_id, request.n)
        # Refused while any lane holds the id, as one scheduler refuses it (its slot may be
        # closed with its cancel still to be taken): the text state and the slot are the
        # id's, so the old request's end would be the new one's.
        for request_id in request_ids:
            if request_id in self._streams or self.holder(request_id) is not None:
                raise DuplicateRequestError(f"request_id {request_id!r} is already in flight")
        lane = self._place(token_array(request.prompt_token_ids), request.cache_salt)
        lane.scheduler.add(request, self._clock())
        lane.processor.open(request)
        slots = []
        for request_id in request_ids:
            self._cancels.pop(request_id, None)  # the old request's: it ended
            slots.append(self._streams.open(request_id))
        lane.loop.wake()
        return slots

    def release(self, slot: OutputSlot) -> None:
        """The slot's reader is gone (it read the end, or its client left): close the slot,
        and cancel the request if it has not finished, so its blocks are free before the
        next step is planned."""
        self._streams.close(slot.request_id)
        if not slot.finished:
            self.cancel(slot.request_id)

    def cancel(
        self,
        request_id: str,
        reason: FinishReason = FinishReason.CANCELLED,
        message: str | None = None,
    ) -> None:
        """Ask for a request to end; its blocks are freed before its lane plans again."""
        lane = self.holder(request_id)
        if lane is None:
            return  # finished, or never here
        if len(self._cancels) > 2 * len(self._streams) + 64:  # forget the finished ones
            self._cancels = {r: c for r, c in self._cancels.items() if self.holder(r)}
        self._cancels[request_id] = (reason, message)
        lane.loop.cancel(request_id, reason, message)

    def stop_accepting(self) -> None:
        """From now on submit() raises Unavailable; requests in flight go on."""
        self._draining = True

    async def drain(self, timeout_s: float) -> None:
        """Stop accepting, let the open streams end for up to `timeout_s`, then cancel the
        rest and give the loops CANCEL_PUBLISH_S to publish their cancellations."""
        self.stop_accepting()
        streams = self._streams
        log.info("draining %d streams for up to %g s", len(streams), timeout_s)
        if await streams.wait_empty(timeout_s):
            return
        log.warning("cancelling %d streams still running after the drain timeout", len(streams))
        for request_id in streams.request_ids():
            self.cancel(request_id)
        await streams.wait_empty(CANCEL_PUBLISH_S)

    def stop(self) -> None:
        self._stopped = True
        for lane in self._lanes:
            lane.loop.stop()
        self._changed.set()

    def is_turning(self) -> bool:
        """Whether no lane's loop is stuck (the systemd watchdog's question)."""
        return all(lane.loop.is_turning() for lane in self._lanes)

    def holder(self, request_id: str) -> _Lane | None:
        """The lane whose scheduler holds the unfinished request, if any."""
        return next((lane for lane in self._lanes if lane.scheduler.holds(request_id)), None)

    # -- for the worker link: WorkerEvents ------------------------------------------------

    def worker_attached(self, info: WorkerInfo) -> None:
        lane = next((lane for lane in self._lanes if lane.identity is None), None)
        if lane is None:
            lane = self._open_lane()
        lane.identity = info.identity
        log.info("worker %s serves lane %d", info.hello.incarnation_id, lane.number)
        lane.loop.worker_attached(info)

    def worker_detached(
        self, reason: str, identity: bytes | None = None, *, suspect: bool = True
    ) -> None:
        """The worker of `identity` is gone (None: the first lane's, as a link of one
        worker reports it)."""
        for lane in self._live_lanes():
            if identity is None or lane.identity == identity:
                lane.identity = None
                lane.loop.worker_detached(reason, suspect=suspect)
                return

    # -- the lanes ---------------------------------------------------------------------

    async def run(self) -> None:
        """Until stop(): the lanes' loops run as tasks; one that fails fails this."""
        try:
            while not self._stopped:
                self._changed.clear()
                changed = asyncio.create_task(self._changed.wait())
                running = {lane.task for lane in self._lanes if lane.task is not None}
                done, _ = await asyncio.wait(
                    {changed, *running}, return_when=asyncio.FIRST_COMPLETED
                )
                changed.cancel()
                for task in done - {changed}:
                    failure = None if task.cancelled() else task.exception()
                    if failure is not None:
                        raise failure
        finally:
            for lane in self._lanes:
                lane.loop.stop()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _open_lane(self) -> _Lane:
        self._num_lanes_opened += 1
        scheduler = Scheduler(self._config)
        processor = OutputProcessor(self._detokenizer_factory, texts=self._texts)
        # `lane` is bound below, before the loop runs: the closures read it when called.
        loop = StepLoop(
            scheduler,
            processor,
            _LaneLink(self._link, lambda: lane.identity),
            self._streams,
            self._metrics,
            self._settings,
            on_worker_change=lambda attached: self._lane_changed(lane, attached),
            clock=self._clock,
        )
        lane = _Lane(self._num_lanes_opened, scheduler, processor, loop)
        lane.task = asyncio.create_task(loop.run(), name=f"step-loop-{lane.number}")
        self._tasks.add(lane.task)
        lane.task.add_done_callback(self._tasks.discard)
        self._lanes.append(lane)
        self._changed.set()
        return lane

    def _lane_changed(self, lane: _Lane, attached: bool) -> None:
        """A lane's loop took its worker's attach or loss (in that loop's turn)."""
        if attached:
            self._ever_attached = True
            self._lost_at_s = None
        elif lane.identity is None and self._live_lanes(besides=lane):
            self._hand_over(lane)
        serving = any(other.loop.worker is not None for other in self._lanes)
        if not serving and self._serving:
            self._lost_at_s = self._clock()
        if serving != self._serving:
            self._serving = serving
            self._on_worker_change(serving)

    def _live_lanes(self, besides: _Lane | None = None) -> list[_Lane]:
        """Lanes with a worker given (their loops may not have taken it yet)."""
        return [lane for lane in self._lanes if lane is not besides and lane.identity is not None]

    def _hand_over(self, lost: _Lane) -> None:
        """Move the lost lane's requests to the live lanes, each placed anew, and close it."""
        requests, suspects = lost.scheduler.hand_over()
        self._lanes.remove(lost)
        lost.loop.stop()
        lost_stats = lost.scheduler.stats
        for name in _CUMULATIVE_STATS:
            self._closed_stats[name] += getattr(lost_stats, name)
        now = self._clock()
        moved: dict[int, list[Request]] = {}
        finished: list[tuple[_Lane, RequestOutput]] = []
        # Placed one by one, so each sees the ones before in the lanes' queues; from the
        # last, as each goes to the head of its new queue, to keep their order.
        for request in reversed(requests):
            lane = self._place(request.token_ids, root_hash=request.cache_root_hash)
            moved.setdefault(id(lane), []).append(request)
            finished += [(lane, output) for output in lane.scheduler.take_over([request], [], now)]
        for lane in self._live_lanes():
            ids = {request.request_id for request in moved.get(id(lane), ())}
            if not ids:
                continue
            lane.scheduler.take_over([], [s for s in suspects if s[0] in ids], now)
            for request_id in ids & self._cancels.keys():
                lane.loop.cancel(request_id, *self._cancels[request_id])
            lane.loop.wake()
        for lane, output in finished:  # too large for the worker it was placed on
            self._streams.publish(lane.processor.process([output]))
            self._metrics.observe_finish(output)
        log.warning(
            "lane %d closed with its worker; %d requests moved to the %d lanes left",
            lost.number,
            len(requests),
            len(self._live_lanes()),
        )

    def _place(self, token_ids, cache_salt: str = "", *, root_hash: int | None = None) -> _Lane:
        """The lane a request of `token_ids` joins: among those with a worker given, by
        placement.choose_lane; the lane waiting for a worker when none has one."""
        lanes = self._live_lanes() or self._lanes
        if len(lanes) == 1:
            return lanes[0]
        if root_hash is None:
            root_hash = cache_root_hash(cache_salt)
        loads = [lane.scheduler.lane_load(token_ids, root_hash) for lane in lanes]
        return lanes[choose_lane(loads, self._config.affinity_max_kv_use_gap)]

    def _check_available(self) -> None:
        if self._stopped:
            raise Unavailable("the server is shutting down")
        if self._draining:
            raise Unavailable("the server is draining for shutdown")
        if self._live_lanes():
            return
        if not self._ever_attached or not self._lanes:
            raise Unavailable("no worker is connected yet")
        lost_at, grace_s = self._lost_at_s, self._settings.worker_grace_s
        if lost_at is not None and self._clock() - lost_at > grace_s:
            raise Unavailable(f"no worker has been connected for over {grace_s:g} s")
