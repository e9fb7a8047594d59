"""What GetServerStats and /metrics report of each attached worker (several with lanes)."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.scheduler_svc.core import SchedulerStats


@dataclass(frozen=True, slots=True)
class WorkerStats:
    incarnation_id: str  # the worker's own id from its hello; the metrics' `worker` label
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    busy_fraction: float  # share of the last BUSY_WINDOW_S it spent inside steps
    num_steps: int  # planned by its scheduler since it attached (or its lane began)
    num_generated_tokens: int


def worker_stats_of(
    incarnation_id: str, stats: SchedulerStats, busy_fraction: float
) -> WorkerStats:
    return WorkerStats(
        incarnation_id=incarnation_id,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_kv_blocks_used=stats.num_kv_blocks_used,
        num_kv_blocks_total=stats.num_kv_blocks_total,
        busy_fraction=busy_fraction,
        num_steps=stats.num_steps,
        num_generated_tokens=stats.num_generated_tokens,
    )
