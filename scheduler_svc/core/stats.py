"""What the scheduler reports about itself (GetServerStats, Prometheus)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_kv_blocks_used: int  # owned by running sequences
    num_kv_blocks_total: int
    num_kv_blocks_cached: int  # ownerless blocks kept for prefix reuse
    prefix_cache_hit_rate: float  # cached prompt tokens / prompt tokens looked up, in [0, 1]
    num_preemptions: int
    num_steps: int
    num_requests_finished: int
    num_generated_tokens: int
    num_prefix_queries_tokens: int  # prompt tokens looked up (first admissions only)
    num_prefix_hit_tokens: int
