"""Placement: which lane (one worker's scheduler) a new request joins, with several workers.

A pure policy over each lane's load as the request sees it:
1. prefix-cache affinity first: the lane whose prefix cache holds the longest prefix of
   the request's blocks, if any holds at least one (a hit saves that prefill and its KV);
2. else the least KV use, counting the blocks its waiting requests will need (a queue
   that will fill the pool is as good as a full pool);
3. ties by fewer running sequences, then by lane order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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


def choose_lane(loads: Sequence[LaneLoad]) -> int:
    """The index in `loads` of the lane a new request joins; `loads` must not be empty."""
    if not loads:
        raise ValueError("no lane to place a request on")
    indices = range(len(loads))
    best_hit = max(load.num_cached_prefix_blocks for load in loads)
    if best_hit > 0:
        indices = [i for i in indices if loads[i].num_cached_prefix_blocks == best_hit]
    return min(indices, key=lambda i: (loads[i].kv_use, loads[i].num_running, i))
