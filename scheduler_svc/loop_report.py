"""What a step loop tells the operator: each step's timings and each finished request in
the metrics, its worker's busy time (its WorkerStats), and a status line in the log every
status_interval_s while there is work."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pagoda.scheduler_svc.core import RequestOutput, SchedulerStats, StepOutputs, StepPlan
from pagoda.scheduler_svc.metrics import Metrics, WorkerBusy

log = logging.getLogger("pagoda.step_loop")


class LoopReport:
    def __init__(
        self,
        metrics: Metrics,
        status_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._status_interval_s = status_interval_s
        # This worker's share of the wall time inside steps; the metrics' worker_busy
        # counts every worker's.
        self.worker_busy = WorkerBusy(clock=clock)
        self._last_status_s = clock()
        self._tokens_since_status = 0

    def observe_step(
        self,
        plan: StepPlan,
        step: StepOutputs,
        *,
        schedule_s: float,
        transport_s: float,
        forward_s: float,
        worker_s: float,
    ) -> None:
        """An applied step: its timings (`worker_s`: the worker's whole time in it, its
        busy time) and its outputs."""
        self.worker_busy.record(worker_s)
        self._metrics.observe_step(
            schedule_s=schedule_s,
            transport_s=transport_s,
            forward_s=forward_s,
            worker_s=worker_s,
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decode_tokens=plan.num_decode_tokens,
        )
        self._tokens_since_status += len(step.token_ids)
        self.observe(step.outputs)

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Count published outputs' tokens; record and log the finished ones."""
        for output in outputs:
            self._tokens_since_status += len(output.token_ids)
            if output.finish_reason is not None:
                self._metrics.observe_finish(output)
                _log_finished(output)

    def log_status(self, now: float, stats: Callable[[], SchedulerStats]) -> None:
        """The status line, once status_interval_s has passed since the last (`stats` is
        read only then)."""
        elapsed_s = now - self._last_status_s
        if elapsed_s < self._status_interval_s:
            return
        figures = stats()
        if figures.num_running or figures.num_waiting or self._tokens_since_status:
            log.info(
                "status: %d running, %d waiting, KV %d/%d blocks, %.1f tokens/s",
                figures.num_running,
                figures.num_waiting,
                figures.num_kv_blocks_used,
                figures.num_kv_blocks_total,
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
