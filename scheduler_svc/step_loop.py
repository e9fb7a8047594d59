"""The step loop: drain the inbox, schedule, send, await the result, apply, publish.

With overlapped steps (the default, for a worker whose hello says feeds_last_sampled),
step N+1 is planned and sent while N runs, so the worker computes N+1 while the loop
awaits, decodes and applies N and plans N+2: at most two steps are in flight, their
results applied in order (see Scheduler). N+1 is planned just before N is predicted to
end (plan_timing.py), so that requests arriving meanwhile join it; the loop publishes N-1's
outputs and waits for that moment or N's result, whichever comes first. Without overlap,
one step at a time. A constrained row of N+1 (structured output) needs N's token for its
mask: N+1 goes out saying its masks follow, and right after N is applied, before anything
else, the loop sends them (grammar_masks.masks_after), while the worker still runs N+1's
forward.

One loop turns one Scheduler (one lane of the serving front, front.py). The front adds
requests to it (safe mid-step: apply() touches running sequences only) and moves a lost
lane's requests; everything else that changes it happens here, in the loop's turn: the
front asks the loop to `wake`, `cancel` or `stop`, and passes on the worker link's
attaches and detaches (`worker_attached` / `worker_detached`), all on the same asyncio
event loop. The loop publishes every output to the front's OutputStreams.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from pagoda.common import step_codec
from pagoda.protos import step_pb2
from pagoda.scheduler_svc import grammar_masks, grammars
from pagoda.scheduler_svc.core import (
    FinishReason,
    RequestOutput,
    Scheduler,
    StepOutputs,
    StepPlan,
    StepResult,
)
from pagoda.scheduler_svc.loop_report import LoopReport
from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.output_processor import OutputProcessor
from pagoda.scheduler_svc.output_streams import OutputStreams
from pagoda.scheduler_svc.plan_timing import PlanTiming
from pagoda.scheduler_svc.worker_link import WorkerInfo, WorkerLost
from pagoda.scheduler_svc.worker_stats import WorkerStats, worker_stats_of

log = logging.getLogger("pagoda.step_loop")

IDLE_TICK_S = 0.5


class _Detach(NamedTuple):
    reason: str
    suspect: bool  # WorkerLost.suspect


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


class StepLink(Protocol):
    """What the loop needs from its worker link (WorkerLink, or a fake in tests).

    Attaches and detaches do not come through here: the link reports them to the
    WorkerEvents given to its start(): the serving front (front.py).
    """

    def start_step(
        self, plan: step_pb2.StepPlan, timeout_s: float
    ) -> asyncio.Future[step_pb2.StepResult]:
        """Send one plan (now, if the link can) and give the future of its result, which
        fails with WorkerLost if the worker does not answer."""
        ...

    def send_masks(self, masks: step_pb2.StepMasks) -> None:
        """Send the masks that follow a plan start_step sent (nothing if it is gone)."""
        ...

    def heard_within(self, seconds: float) -> bool:
        """Whether the worker sent anything in the last `seconds` (heartbeats included)."""
        ...


@dataclass(frozen=True, slots=True)
class LoopSettings:
    worker_timeout_s: float  # a step's result (or a heartbeat) must come within this
    worker_grace_s: float  # requests wait this long for a new worker after a detach
    status_interval_s: float  # between status log lines
    idle_tick_s: float = IDLE_TICK_S  # an idle loop turns at least this often
    # Plan step N+1 while N runs, when the worker substitutes last sampled tokens
    # (None: unless it is a CPU worker, see overlaps()).
    overlap_steps: bool | None = None
    # Overlapped: plan N+1 just before N is predicted to end (plan_timing.py), not as
    # soon as N is sent.
    late_plan_ahead: bool = True


def apply_step(
    scheduler: Scheduler, processor: OutputProcessor, result: StepResult, now: float
) -> StepOutputs:
    """A step's result through the core, then the text stage; the requests the text stage
    finished (a stop string, a lost text state) end in the core before this returns, so
    their blocks are free before the next schedule()."""
    step = scheduler.apply(result, now)
    for output in processor.process_step(step):
        if output.finish_reason is FinishReason.STOP:
            ended = scheduler.stop(output.request_id, now, output.num_dropped_tokens)
        else:
            ended = scheduler.cancel(
                output.request_id, now, FinishReason.ERROR, output.error_message
            )
        if ended is not None:
            output.usage, output.timings = ended.usage, ended.timings
    return step


@dataclass(slots=True)
class _Flight:
    """A step sent to the worker; `result` completes with its answer or WorkerLost."""

    decision: StepPlan
    result: asyncio.Future[step_pb2.StepResult]
    started_s: float  # when planning began
    encoded_s: float  # when it was ready to send
    # Its masks that follow (StepPlan.masks_follow), until sent once the step before it
    # is answered or failed.
    masks: grammar_masks.PendingMasks | None = None


@dataclass(frozen=True, slots=True)
class _Cancel:
    request_id: str
    reason: FinishReason
    message: str | None


class StepLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        processor: OutputProcessor,
        link: StepLink,
        streams: OutputStreams,
        metrics: Metrics,
        settings: LoopSettings,
        *,
        on_worker_change: Callable[[bool], None] = lambda attached: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`processor`: gives each step's outputs their text right after apply();
        `streams`: the front's output slots, where every output is published;
        `on_worker_change`: told of each attach (True) and detach (False), in the loop's turn."""
        self._scheduler = scheduler
        self._processor = processor
        self._link = link
        self._streams = streams
        self._settings = settings
        self._on_worker_change = on_worker_change
        self._clock = clock
        self._report = LoopReport(metrics, settings.status_interval_s, clock)
        self._flights: deque[_Flight] = deque()  # oldest first, at most two
        self._last_received_s = 0.0
        self._timing = PlanTiming()
        # The outputs of the step applied last, published once its successor is sent: the
        # worker gets its next plan before the stream writers they wake take the loop.
        self._unpublished: StepOutputs | None = None
        self._worker: WorkerInfo | None = None
        self._wake = asyncio.Event()
        self._cancels: list[_Cancel] = []
        self._worker_events: list[WorkerInfo | _Detach] = []
        self._worker_lost_at_s: float | None = None
        self._stopped = False
        self._last_turn_s = clock()

    # -- for the front (same event loop) --------------------------------------------------

    @property
    def worker(self) -> WorkerInfo | None:
        """The worker the loop runs steps on, None between a detach and the next attach."""
        return self._worker

    def worker_stats(self) -> list[WorkerStats]:
        """The attached worker's figures (none between a detach and the next attach)."""
        worker = self._worker
        if worker is None:
            return []
        busy_fraction = self._report.worker_busy.fraction()
        return [worker_stats_of(worker.hello.incarnation_id, self._scheduler.stats, busy_fraction)]

    def wake(self) -> None:
        """New work was queued in the scheduler: plan now."""
        self._wake.set()

    def cancel(
        self,
        request_id: str,
        reason: FinishReason = FinishReason.CANCELLED,
        message: str | None = None,
    ) -> None:
        """Ask for a request to end; its blocks are freed before the next step is planned."""
        self._cancels.append(_Cancel(request_id, reason, message))
        self._wake.set()

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
        settings = self._settings
        limit_s = settings.worker_timeout_s + 2 * settings.idle_tick_s + 1.0
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
            plan_at = None
            if self._may_plan():
                plan_at = self._plan_ahead_at(now)
                if plan_at is None:
                    if self._flights:
                        self._timing.planning(now)
                    decision = self._scheduler.schedule(now, ahead=bool(self._flights))
                    if decision is not None:
                        self._send(decision, now)
                        continue  # plan the next one too, if it may be planned ahead
            self._publish_applied()
            if self._flights:
                await self._finish_oldest(plan_at)
                self._report.log_status(self._clock(), lambda: self._scheduler.stats)
                continue
            self._expire_without_worker(now)
            self._report.log_status(now, lambda: self._scheduler.stats)
            self._streams.end_holds()  # no step comes to end a stalled writer's hold
            await self._idle()

    def _may_plan(self) -> bool:
        """No step is in flight, or one is and the next may be planned ahead of its result."""
        worker = self._worker
        if worker is None:
            return False
        if not self._flights:
            return True
        overlapped = overlaps(self._settings.overlap_steps, worker.hello)
        return overlapped and self._scheduler.can_plan_ahead

    def _plan_ahead_at(self, now: float) -> float | None:
        """When to plan the step after the one in flight (None: now, or no step is in
        flight). It began on the worker when sent or when the step before it ended."""
        if not self._flights or not self._settings.late_plan_ahead:
            return None
        flight = self._flights[-1]
        started_s = max(flight.encoded_s, self._last_received_s)
        return self._timing.plan_at(flight.decision, started_s, now)

    def _send(self, decision: StepPlan, started_s: float) -> None:
        masks = None
        if grammars.any_live():
            vocab_size = self._worker.hello.vocab_size
            masks = grammar_masks.fill_masks(decision, self._scheduler.request_of, vocab_size)
        plan = step_codec.encode_plan(decision)
        encoded_s = self._clock()
        self._timing.planned(encoded_s - started_s)
        result = self._link.start_step(plan, self._settings.worker_timeout_s)
        self._flights.append(_Flight(decision, result, started_s, encoded_s, masks))

    def _send_masks(self) -> None:
        """The step before the oldest in flight is applied or failed: send the oldest's
        masks if they follow it (empty when its constrained requests ended or were
        requeued), so its worker never waits for them in vain."""
        flight = self._flights[0] if self._flights else None
        if flight is None or flight.masks is None:
            return
        masks = grammar_masks.masks_after(flight.masks, self._scheduler.request_of)
        flight.masks = None
        self._link.send_masks(step_codec.encode_masks(masks))

    async def _finish_oldest(self, plan_at: float | None = None) -> None:
        """Await the oldest step's result and apply it (or fail it with the worker); its
        outputs wait in _unpublished for the next turn to plan and send first. With
        `plan_at`, the next step is to be planned then: return at that moment (or when
        woken) if the result has not come by then."""
        flight = self._flights[0]
        decision = flight.decision
        if plan_at is not None and not await self._result_before(flight.result, plan_at):
            return
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
            self._send_masks()
            return
        self._flights.popleft()
        received_s = self._clock()
        # A step sent behind another started on the worker when that one ended.
        sent_s = max(flight.encoded_s, self._last_received_s)
        self._last_received_s = received_s
        outcome = step_codec.decode_result(result)
        if outcome.step_error:
            log.error("worker failed step %d: %s", decision.step_id, outcome.step_error)
        else:
            self._timing.result(decision, result.total_ms / 1000, received_s)
        events = apply_step(self._scheduler, self._processor, outcome, received_s)
        self._send_masks()  # the worker may be waiting for them to sample
        self._unpublished = events
        self._report.observe_step(
            decision,
            events,
            schedule_s=flight.encoded_s - flight.started_s,
            transport_s=max(0.0, received_s - sent_s - result.total_ms / 1000),
            forward_s=result.forward_ms / 1000,
            worker_s=result.total_ms / 1000,
        )

    async def _result_before(self, result: asyncio.Future, deadline_s: float) -> bool:
        """Wait for `result` until `deadline_s` on the loop's clock, or until woken (new
        work, a cancel, a stop: the turn looks again); whether the result came."""
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait(
                (result, woken),
                timeout=max(0.0, deadline_s - self._clock()),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            woken.cancel()
        return result.done()

    async def _idle(self) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), self._settings.idle_tick_s)
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
        self._timing.reset()
        self._worker_lost_at_s = None
        geometry = step_codec.geometry_from_hello(info.hello)
        overlapped = overlaps(self._settings.overlap_steps, info.hello)
        self._publish(self._scheduler.attach_worker(geometry, overlapped=overlapped))
        drafts = self._scheduler.speculative_tokens
        log.info(
            "worker %s: %s, %s",
            info.hello.incarnation_id,
            "steps overlapped" if overlapped else "one step at a time",
            f"up to {drafts} drafts per decoding request" if drafts else "no speculation",
        )
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
            self._settings.worker_grace_s,
        )

    def _expire_without_worker(self, now: float) -> None:
        """Past the grace period without a worker, every unfinished request ends UNAVAILABLE."""
        lost_at, grace_s = self._worker_lost_at_s, self._settings.worker_grace_s
        if self._worker is not None or lost_at is None or now - lost_at <= grace_s:
            return
        for request_id in list(self._streams.request_ids()):
            output = self._scheduler.cancel(
                request_id,
                now,
                FinishReason.ERROR,
                f"no worker came back within {grace_s:g} s",
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
        self._processor.process(outputs)
        self._streams.publish(outputs)
        self._report.observe(outputs)
