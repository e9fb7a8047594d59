"""The step loop: drain the inbox, schedule, send, await the result, apply, publish.

With overlapped steps (the default, for a worker whose hello says feeds_last_sampled),
step N+1 is planned and sent as soon as N is sent, so the worker computes N+1 while the
loop awaits, decodes and applies N and plans N+2: at most two steps are in flight, their
results applied in order (see Scheduler). Without, one step at a time.

It is the only code that mutates the Scheduler between steps. The servicer talks to it
through `submit`, `release`, `cancel`, `stats` and `worker`; the worker link reports
attaches and detaches through `worker_attached` / `worker_detached` (WorkerEvents), all on
the same asyncio event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from pagoda.protos import step_pb2
from pagoda.scheduler_svc import grammars
from pagoda.scheduler_svc.core import (
    FinishReason,
    RequestOutput,
    Scheduler,
    SchedulerStats,
    StepOutputs,
    StepPlan,
    TenantStats,
    ValidRequest,
)
from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.output_processor import OutputProcessor
from pagoda.scheduler_svc.output_streams import (
    MAX_UNREAD_TOKENS,
    OutputSlot,
    OutputStreams,
    unread_message,
)
from pagoda.scheduler_svc.worker_link import WorkerInfo, WorkerLost
from pagoda.scheduler_svc.worker_stats import WorkerStats, worker_stats_of

from pagoda.common import step_codec

log = logging.getLogger("pagoda.step_loop")

IDLE_TICK_S = 0.5
# After the drain timeout, how long cancelled streams get to see their last output.
CANCEL_PUBLISH_S = 2.0


class _Detach(NamedTuple):
    reason: str
    suspect: bool  # WorkerLost.suspect


async def drain_streams(
    streams: OutputStreams, cancel: Callable[[str], None], timeout_s: float
) -> None:
    """Let the open streams end for up to `timeout_s`, then `cancel` the rest and give
    their cancellations CANCEL_PUBLISH_S to reach the readers."""
    log.info("draining %d streams for up to %g s", len(streams), timeout_s)
    if await streams.wait_empty(timeout_s):
        return
    log.warning("cancelling %d streams still running after the drain timeout", len(streams))
    for request_id in streams.request_ids():
        cancel(request_id)
    await streams.wait_empty(CANCEL_PUBLISH_S)


def overlaps(overlap_steps: bool | None, hello: step_pb2.Hello) -> bool:
    """Whether steps overlap on this worker: it must feed its last sampled tokens, and
    `overlap_steps` unset means on except for a CPU worker. There a step takes tens to
    hundreds of milliseconds against the scheduler's one or two, so planning ahead hides
    almost nothing, while a request that arrives waits behind two steps instead of one
    (trickle-short's TTFT p99: 276 ms overlapped, 208 ms serial, at the same tokens/s)."""
    if not hello.feeds_last_sampled:
        return False
    if overlap_steps is None:
        return hello.device.partition(":")[0] != "cpu"
    return overlap_steps


class Unavailable(Exception):
    """No worker can serve a new request now (none attached, or draining); a sentence."""


class StepLink(Protocol):
    """What the loop needs from its worker link (WorkerLink, or a fake in tests).

    Attaches and detaches do not come through here: the link reports them to the
    WorkerEvents given to its start(), which the loop implements.
    """

    def start_step(
        self, plan: step_pb2.StepPlan, timeout_s: float
    ) -> asyncio.Future[step_pb2.StepResult]:
        """Send one plan (now, if the link can) and give the future of its result, which
        fails with WorkerLost if the worker does not answer."""
        ...


@dataclass(slots=True)
class _Flight:
    """A step sent to the worker; `result` completes with its answer or WorkerLost."""

    decision: StepPlan
    result: asyncio.Future[step_pb2.StepResult]
    started_s: float  # when planning began
    encoded_s: float  # when it was ready to send


@dataclass(frozen=True, slots=True)
class _Cancel:
    request_id: str
    reason: FinishReason
    message: str | None


class StepLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        link: StepLink,
        metrics: Metrics,
        *,
        output_processor: OutputProcessor,
        worker_timeout_s: float,
        worker_grace_s: float,
        status_interval_s: float,
        on_worker_change: Callable[[bool], None] = lambda attached: None,
        clock: Callable[[], float] = time.monotonic,
        idle_tick_s: float = IDLE_TICK_S,
        overlap_steps: bool | None = None,
        streams: OutputStreams | None = None,
    ) -> None:
        """`streams`: the output slots, when several loops (lanes.py, one per worker)
        share them; by default the loop's own."""
        self._scheduler = scheduler
        # Plan step N+1 while N runs, when the worker substitutes last sampled tokens
        # (None: unless it is a CPU worker, see overlaps()).
        self._overlap_steps = overlap_steps
        self._flights: deque[_Flight] = deque()  # oldest first, at most two
        self._last_received_s = 0.0
        # The outputs of the step applied last, published once its successor is sent: the
        # worker gets its next plan before the stream writers they wake take the loop.
        self._unpublished: StepOutputs | None = None
        # Gives each step's outputs their text right after apply(), and ends stop-string
        # hits before the next schedule().
        self._output_processor = output_processor
        self._link = link
        self._metrics = metrics
        # A client that stops reading has its request ended, not its output piled up.
        if streams is None:
            streams = OutputStreams(
                on_overflow=lambda request_id: self.cancel(
                    request_id, FinishReason.ERROR, unread_message(MAX_UNREAD_TOKENS)
                )
            )
        self._streams = streams
        self._worker: WorkerInfo | None = None
        self._worker_timeout_s = worker_timeout_s
        self._worker_grace_s = worker_grace_s
        self._status_interval_s = status_interval_s
        self._on_worker_change = on_worker_change
        self._clock = clock
        self._idle_tick_s = idle_tick_s
        self._wake = asyncio.Event()
        self._cancels: list[_Cancel] = []
        self._worker_events: list[WorkerInfo | _Detach] = []
        self._worker_lost_at_s: float | None = None
        self._ever_attached = False
        self._draining = False
        self._stopped = False
        self._last_status_s = clock()
        self._tokens_since_status = 0
        self._last_turn_s = clock()

    # -- for the servicer (same event loop) -----------------------------------------------

    @property
    def worker(self) -> WorkerInfo | None:
        """The worker the loop runs steps on, None between a detach and the next attach."""
        return self._worker

    @property
    def stats(self) -> SchedulerStats:
        return self._scheduler.stats

    def tenant_stats(self) -> list[TenantStats]:
        return self._scheduler.tenant_stats()

    def worker_stats(self) -> list[WorkerStats]:
        """The attached worker's figures (none between a detach and the next attach)."""
        worker = self._worker
        if worker is None:
            return []
        busy_fraction = self._metrics.worker_busy.fraction()
        return [worker_stats_of(worker.hello.incarnation_id, self.stats, busy_fraction)]

    def wake(self) -> None:
        """New work was queued in the scheduler from outside (lanes.py): plan now."""
        self._wake.set()

    @property
    def draining(self) -> bool:
        return self._draining

    def submit(self, request: ValidRequest) -> OutputSlot:
        """Queue a validated request and open its output slot; `release` it when done reading.

        Raises Unavailable, or the scheduler's QueueFullError / RequestTooLargeError.
        Adding to the waiting queue is safe mid-step: apply() touches running sequences only.
        """
        self._check_available()
        if request.request_id in self._streams:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        self._output_processor.add(request, self._clock())
        slot = self._streams.open(request.request_id)
        self._wake.set()
        return slot

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
        """Ask for a request to end; its blocks are freed before the next step is planned."""
        self._cancels.append(_Cancel(request_id, reason, message))
        self._wake.set()

    def stop_accepting(self) -> None:
        """From now on submit() raises Unavailable; requests in flight go on."""
        self._draining = True

    async def drain(self, timeout_s: float) -> None:
        """Stop accepting, let the open streams end for up to `timeout_s`, then cancel the
        rest and give the loop CANCEL_PUBLISH_S to publish their cancellations."""
        self.stop_accepting()
        await drain_streams(self._streams, self.cancel, timeout_s)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    # -- for the worker link: WorkerEvents ------------------------------------------------

    def worker_attached(self, info: WorkerInfo) -> None:
        self._worker_events.append(info)
        self._wake.set()

    def worker_detached(self, reason: str, *, suspect: bool = True) -> None:
        self._worker_events.append(_Detach(reason, suspect))
        self._wake.set()

    # -- the loop --------------------------------------------------------------------

    def is_turning(self) -> bool:
        """Whether the loop is not stuck: it began a turn recently enough (an idle turn
        takes idle_tick_s), or it awaits a step whose worker spoke within the worker
        timeout (a long step's worker sends heartbeats; a silent one is lost by then)."""
        limit_s = self._worker_timeout_s + 2 * self._idle_tick_s + 1.0
        if self._clock() - self._last_turn_s <= limit_s:
            return True
        return bool(self._flights) and self._link.heard_within(limit_s)

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self._publish_applied()
            for flight in self._flights:  # stopped with steps in flight: nobody awaits them
                flight.result.cancel()

    async def _run(self) -> None:
        while not self._stopped:
            now = self._clock()
            self._last_turn_s = now
            self._drain_inbox(now)
            if self._may_plan():
                decision = self._scheduler.schedule(now, ahead=bool(self._flights))
                if decision is not None:
                    self._send(decision, now)
                    continue  # plan the next one too, if it may be planned ahead
            self._publish_applied()
            if self._flights:
                await self._finish_oldest()
                self._log_status(self._clock())
                continue
            self._expire_without_worker(now)
            self._log_status(now)
            self._streams.end_holds()  # no step comes to end a stalled writer's hold
            await self._idle()

    def _may_plan(self) -> bool:
        """No step is in flight, or one is and the next may be planned ahead of its result."""
        worker = self._worker
        if worker is None:
            return False
        if not self._flights:
            return True
        return overlaps(self._overlap_steps, worker.hello) and self._scheduler.can_plan_ahead

    def _send(self, decision: StepPlan, started_s: float) -> None:
        if grammars.any_live():
            vocab_size = self._worker.hello.vocab_size
            grammars.fill_masks(decision, self._scheduler.request_of, vocab_size)
        plan = step_codec.encode_plan(decision)
        encoded_s = self._clock()
        result = self._link.start_step(plan, self._worker_timeout_s)
        self._flights.append(_Flight(decision, result, started_s, encoded_s))

    async def _finish_oldest(self) -> None:
        """Await the oldest step's result and apply it (or fail it with the worker); its
        outputs wait in _unpublished for the next turn to plan and send first."""
        flight = self._flights[0]
        decision = flight.decision
        try:
            result = await flight.result
        except WorkerLost as exc:
            self._flights.popleft()
            log.warning(
                "step %d lost with the worker (%s); its requests will be recomputed",
                decision.step_id,
                exc,
            )
            self._publish(
                self._scheduler.fail_step(decision, str(exc), self._clock(), suspect=exc.suspect)
            )
            return
        self._flights.popleft()
        received_s = self._clock()
        # A step sent behind another started on the worker when that one ended.
        sent_s = max(flight.encoded_s, self._last_received_s)
        self._last_received_s = received_s
        outcome = step_codec.decode_result(result)
        if outcome.step_error:
            log.error("worker failed step %d: %s", decision.step_id, outcome.step_error)
        events = self._output_processor.process_step(
            self._scheduler.apply(outcome, received_s), received_s
        )
        self._unpublished = events
        self._tokens_since_status += len(events.token_ids)
        self._observe(events.outputs)
        self._metrics.observe_step(
            schedule_s=flight.encoded_s - flight.started_s,
            transport_s=max(0.0, received_s - sent_s - result.total_ms / 1000),
            forward_s=result.forward_ms / 1000,
            worker_s=result.total_ms / 1000,
            num_prefill_tokens=decision.num_prefill_tokens,
            num_decode_tokens=decision.num_decode_tokens,
        )

    async def _idle(self) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), self._idle_tick_s)
        except TimeoutError:
            pass
        self._wake.clear()

    def _drain_inbox(self, now: float) -> None:
        self._wake.clear()
        events, self._worker_events = self._worker_events, []
        for event in events:
            if isinstance(event, _Detach):
                self._detach(event.reason, now, suspect=event.suspect)
            else:
                self._attach(event)
        cancels, self._cancels = self._cancels, []
        for cancel in cancels:
            output = self._scheduler.cancel(cancel.request_id, now, cancel.reason, cancel.message)
            if output is not None:
                self._publish([output])

    def _attach(self, info: WorkerInfo) -> None:
        self._worker = info
        self._ever_attached = True
        self._worker_lost_at_s = None
        self._publish(self._scheduler.attach_worker(step_codec.geometry_from_hello(info.hello)))
        self._on_worker_change(True)

    def _detach(self, reason: str, now: float, *, suspect: bool = True) -> None:
        if self._worker is None:
            return
        self._worker = None
        self._worker_lost_at_s = now
        # Steps in flight are lost with it: a request that killed it may end here.
        self._publish(self._scheduler.detach_worker(reason, suspect=suspect))
        self._on_worker_change(False)
        if self._stopped:  # data parallel: the lane's requests went to the workers left
            log.warning("worker detached (%s); its lane is closed", reason)
            return
        log.warning(
            "worker detached (%s); requests wait up to %g s for a new one",
            reason,
            self._worker_grace_s,
        )

    def _check_available(self) -> None:
        if self._stopped:
            raise Unavailable("the server is shutting down")
        if self._draining:
            raise Unavailable("the server is draining for shutdown")
        if self._worker is not None:
            return
        if not self._ever_attached:
            raise Unavailable("no worker is connected yet")
        lost_at = self._worker_lost_at_s
        if lost_at is not None and self._clock() - lost_at > self._worker_grace_s:
            raise Unavailable(f"no worker has been connected for over {self._worker_grace_s:g} s")

    def _expire_without_worker(self, now: float) -> None:
        """Past the grace period without a worker, every unfinished request ends UNAVAILABLE."""
        lost_at = self._worker_lost_at_s
        if self._worker is not None or lost_at is None or now - lost_at <= self._worker_grace_s:
            return
        for request_id in list(self._streams.request_ids()):
            output = self._scheduler.cancel(
                request_id,
                now,
                FinishReason.ERROR,
                f"no worker came back within {self._worker_grace_s:g} s",
            )
            if output is not None:
                self._streams.set_error_code(request_id, "UNAVAILABLE")
                self._publish([output])

    def _publish_applied(self) -> None:
        events, self._unpublished = self._unpublished, None
        if events is not None:
            self._streams.publish_step(events)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self._publish_applied()  # a request's tokens go out before its end
        self._output_processor.process(outputs)
        self._streams.publish(outputs)
        self._observe(outputs)

    def _observe(self, outputs: list[RequestOutput]) -> None:
        """Count published outputs' tokens; record and log the finished ones."""
        for output in outputs:
            self._tokens_since_status += len(output.token_ids)
            if output.finish_reason is not None:
                self._metrics.observe_finish(output)
                _log_finished(output)

    def _log_status(self, now: float) -> None:
        elapsed_s = now - self._last_status_s
        if elapsed_s < self._status_interval_s:
            return
        stats = self._scheduler.stats
        if stats.num_running or stats.num_waiting or self._tokens_since_status:
            log.info(
                "status: %d running, %d waiting, KV %d/%d blocks, %.1f tokens/s",
                stats.num_running,
                stats.num_waiting,
                stats.num_kv_blocks_used,
                stats.num_kv_blocks_total,
                self._tokens_since_status / elapsed_s,
            )
        self._last_status_s = now
        self._tokens_since_status = 0


def _log_finished(output: RequestOutput) -> None:
    usage, timings = output.usage, output.timings
    log.info(
        "request %s %s: prompt %d tokens (%d cached), %d generated, TTFT %.1f ms, total %.1f ms%s",
        output.request_id,
        output.finish_reason.name.lower() if output.finish_reason else "?",
        usage.prompt_tokens if usage else 0,
        usage.cached_prompt_tokens if usage else 0,
        usage.completion_tokens if usage else 0,
        timings.first_token_ms if timings else 0.0,
        timings.total_ms if timings else 0.0,
        f" ({output.error_message})" if output.error_message else "",
    )
