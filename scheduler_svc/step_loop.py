"""The step loop: drain the inbox, schedule, send, await the result, apply, publish.

It is the only code that mutates the Scheduler between steps. Everything else (the
servicer, the worker link) talks to it through `submit`, `cancel` and the attach /
detach callbacks, all on the same asyncio event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagoda.scheduler_svc import step_codec
from pagoda.scheduler_svc.core.request import FinishReason, RequestOutput, ValidRequest
from pagoda.scheduler_svc.core.scheduler import Scheduler
from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.output_streams import OutputSlot, OutputStreams
from pagoda.scheduler_svc.worker_link import WorkerInfo, WorkerLink, WorkerLost

log = logging.getLogger("pagoda.step_loop")

IDLE_TICK_S = 0.5


class Unavailable(Exception):
    """No worker can serve a new request now (none attached, or draining); a sentence."""


@dataclass(frozen=True, slots=True)
class _Cancel:
    request_id: str
    reason: FinishReason
    message: str | None


class StepLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        streams: OutputStreams,
        metrics: Metrics,
        *,
        worker_timeout_s: float,
        worker_grace_s: float,
        status_interval_s: float,
        on_worker_change: Callable[[bool], None] = lambda attached: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.streams = streams
        self.metrics = metrics
        self.link: WorkerLink | None = None
        self.worker: WorkerInfo | None = None
        self._worker_timeout_s = worker_timeout_s
        self._worker_grace_s = worker_grace_s
        self._status_interval_s = status_interval_s
        self._on_worker_change = on_worker_change
        self._clock = clock
        self._wake = asyncio.Event()
        self._cancels: list[_Cancel] = []
        self._worker_events: list[WorkerInfo | str] = []
        self._worker_lost_at_s: float | None = None
        self._ever_attached = False
        self._stopped = False
        self._last_status_s = clock()
        self._tokens_since_status = 0
        self._last_turn_s = clock()

    # -- called by the servicer and the worker link (same event loop) --------------

    def submit(self, request: ValidRequest) -> OutputSlot:
        """Queue a validated request and open its output slot.

        Raises Unavailable, or the scheduler's QueueFullError / RequestTooLargeError.
        Adding to the waiting queue is safe mid-step: apply() touches running sequences only.
        """
        self._check_available()
        if request.request_id in self.streams:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        self.scheduler.add(request, self._clock())
        slot = self.streams.open(request.request_id)
        self._wake.set()
        return slot

    def cancel(
        self,
        request_id: str,
        reason: FinishReason = FinishReason.CANCELLED,
        message: str | None = None,
    ) -> None:
        """Ask for a request to end; its blocks are freed before the next step is planned."""
        self._cancels.append(_Cancel(request_id, reason, message))
        self._wake.set()

    def worker_attached(self, info: WorkerInfo) -> None:
        self._worker_events.append(info)
        self._wake.set()

    def worker_detached(self, reason: str) -> None:
        self._worker_events.append(reason)
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    # -- the loop --------------------------------------------------------------------

    def is_turning(self) -> bool:
        """Whether the loop began a turn recently enough: an idle turn takes IDLE_TICK_S and
        a step at most the worker timeout, so a longer silence means the loop is stuck."""
        limit_s = self._worker_timeout_s + 2 * IDLE_TICK_S + 1.0
        return self._clock() - self._last_turn_s <= limit_s

    async def run(self) -> None:
        while not self._stopped:
            now = self._clock()
            self._last_turn_s = now
            self._drain_inbox(now)
            decision = self.scheduler.schedule(now) if self.worker is not None else None
            if decision is None:
                self._expire_without_worker(now)
                self._log_status(now)
                await self._idle()
                continue
            await self._run_step(decision)
            self._log_status(self._clock())

    async def _run_step(self, decision) -> None:
        assert self.link is not None
        started_s = self._clock()
        plan = step_codec.encode_plan(decision)
        encoded_s = self._clock()
        try:
            result = await self.link.run_step(plan, self._worker_timeout_s)
        except WorkerLost as exc:
            log.warning(
                "step %d lost with the worker (%s); its requests will be recomputed",
                decision.step_id,
                exc,
            )
            self._publish(self.scheduler.fail_step(decision, str(exc), self._clock()))
            return
        received_s = self._clock()
        outcome = step_codec.decode_result(result)
        if outcome.step_error:
            log.error("worker failed step %d: %s", decision.step_id, outcome.step_error)
        events = self.scheduler.apply(outcome, received_s)
        self.streams.publish_step(events)
        self._tokens_since_status += len(events.token_ids)
        self._observe(events.outputs)
        self.metrics.observe_step(
            schedule_s=encoded_s - started_s,
            transport_s=max(0.0, received_s - encoded_s - result.total_ms / 1000),
            forward_s=result.forward_ms / 1000,
            num_prefill_tokens=decision.num_prefill_tokens,
            num_decode_tokens=decision.num_decode_tokens,
        )

    async def _idle(self) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), IDLE_TICK_S)
        except TimeoutError:
            pass
        self._wake.clear()

    def _drain_inbox(self, now: float) -> None:
        self._wake.clear()
        events, self._worker_events = self._worker_events, []
        for event in events:
            if isinstance(event, str):
                self._detach(event, now)
            else:
                self._attach(event)
        cancels, self._cancels = self._cancels, []
        for cancel in cancels:
            output = self.scheduler.cancel(cancel.request_id, now, cancel.reason, cancel.message)
            if output is not None:
                self._publish([output])

    def _attach(self, info: WorkerInfo) -> None:
        self.worker = info
        self._ever_attached = True
        self._worker_lost_at_s = None
        self._publish(self.scheduler.attach_worker(step_codec.geometry_from_hello(info.hello)))
        self._on_worker_change(True)

    def _detach(self, reason: str, now: float) -> None:
        if self.worker is None:
            return
        self.worker = None
        self._worker_lost_at_s = now
        self.scheduler.detach_worker()
        self._on_worker_change(False)
        log.warning(
            "worker detached (%s); requests wait up to %g s for a new one",
            reason,
            self._worker_grace_s,
        )

    def _check_available(self) -> None:
        if self._stopped:
            raise Unavailable("the server is shutting down")
        if self.worker is not None:
            return
        if not self._ever_attached:
            raise Unavailable("no worker is connected yet")
        lost_at = self._worker_lost_at_s
        if lost_at is not None and self._clock() - lost_at > self._worker_grace_s:
            raise Unavailable(f"no worker has been connected for over {self._worker_grace_s:g} s")

    def _expire_without_worker(self, now: float) -> None:
        """Past the grace period without a worker, every unfinished request ends UNAVAILABLE."""
        lost_at = self._worker_lost_at_s
        if self.worker is not None or lost_at is None or now - lost_at <= self._worker_grace_s:
            return
        for request_id in list(self.streams.request_ids()):
            output = self.scheduler.cancel(
                request_id,
                now,
                FinishReason.ERROR,
                f"no worker came back within {self._worker_grace_s:g} s",
            )
            if output is not None:
                self.streams.set_error_code(request_id, "UNAVAILABLE")
                self._publish([output])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self.streams.publish(outputs)
        self._observe(outputs)

    def _observe(self, outputs: list[RequestOutput]) -> None:
        """Count published outputs' tokens; record and log the finished ones."""
        for output in outputs:
            self._tokens_since_status += len(output.token_ids)
            if output.finish_reason is not None:
                self.metrics.observe_finish(output)
                _log_finished(output)

    def _log_status(self, now: float) -> None:
        elapsed_s = now - self._last_status_s
        if elapsed_s < self._status_interval_s:
            return
        stats = self.scheduler.stats
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
