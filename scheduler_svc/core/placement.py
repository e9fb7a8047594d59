"""Placement: which lane (one worker's scheduler) a new request joins, with several workers.

A pure policy over each lane's load as the request sees it. Load is KV use: the blocks
running sequences hold plus those the waiting requests will need, as a share of the
lane's pool (a queue that will fill the pool is as good as a full pool).
1. Only lanes whose load is within `max_affinity_gap` of the least-loaded lane's are
   candidates; the least-loaded lane always is one.
2. Among them, prefix-cache affinity: the longest cached prefix of the request's blocks
   (a hit saves that prefill and its KV).
3. Ties (no hit anywhere included) by the least load, then fewer running sequences, then
   lane order.

The gap weighs a hit against load, as SGLang's cache-aware router does: a lane that
cached a shared system prompt takes the requests that share it while its load is within
the gap of the lightest, and the rest spill over to the others rather than queue behind
it; those cache the prompt on their first such request, and affinity spreads again. 0:
least load only (a hit breaks ties); infinity: affinity whatever the load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The default gap: a quarter of a pool. Well within it, a hit's saved prefill is worth
# more than the wait behind a slightly longer queue; past it the wait dominates.
DEFAULT_AFFINITY_MAX_KV_USE_GAP = 0.25


@dataclass(frozen=True, slots=True)
class LaneLoad:
    """One lane's state as seen by a request to place."""

    num_cached_prefix_blocks: int  # of the request's prompt, held by this lane's cache
    num_kv_blocks_used: int  # owned by running sequences
    num_kv_blocks_queued: int  # what its waiting requests' tokens will need
    num_kv_blocks_total: int
    num_running: int

    @property
    def kv_use(self) -> float:
        """Used and queued blocks as a share of the pool (above 1 with a long queue)."""
        demand = self.num_kv_blocks_used + self.num_kv_blocks_queued
        return demand / self.num_kv_blocks_total if self.num_kv_blocks_total else float("inf")


def choose_lane(
    loads: Sequence[LaneLoad], max_affinity_gap: float = DEFAULT_AFFINITY_MAX_KV_USE_GAP
) -> int:
    """The index in `loads` of the lane a new request joins; `loads` must not be empty.
    `max_affinity_gap`: how much more KV use (a share of a pool) than the least-loaded
    lane a lane may have and still win by its cached prefix."""
    if not loads:
        raise ValueError("no lane to place a request on")
    least_use = min(load.kv_use for load in loads)
    candidates = [i for i, load in enumerate(loads) if load.kv_use <= least_use + max_affinity_gap]
    return min(
        candidates,
        key=lambda i: (
            -loads[i].num_cached_prefix_blocks,
            loads[i].kv_use,
            loads[i].num_running,
            i,
        ),
    )
