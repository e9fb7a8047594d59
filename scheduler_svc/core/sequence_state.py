"""Who waits, who runs, and which KV blocks each running sequence owns.

Shared by the step planner (which admits, feeds and preempts) and the Scheduler (which
finishes and resets). Every block a sequence holds is released in `release_sequence`,
the one path used by finish, preemption and requeue after a failed step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pagoda.scheduler_svc.core.block_allocator import BlockAllocator
from pagoda.scheduler_svc.core.config import SchedulerConfig
from pagoda.scheduler_svc.core.prefix_cache import PrefixCache
from pagoda.scheduler_svc.core.request import Request, RequestState
from pagoda.scheduler_svc.core.step_decision import WorkerGeometry
from pagoda.scheduler_svc.core.waiting_queue import WaitingQueue


class SequenceState:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.by_priority = config.admission_policy == "priority"
        # The last worker's geometry; kept while detached so add() can still refuse.
        self.geometry: WorkerGeometry | None = None
        self.blocks: PrefixCache | None = None  # None while no worker is attached
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = WaitingQueue(by_priority=self.by_priority)
        # seq_id -> request, in admission order (preemption takes from the end).
        self.running: dict[int, Request] = {}
        # The running ones with tokens left to feed before their next sample.
        self.prefilling: dict[int, Request] = {}
        self.forget_seq_ids: list[int] = []  # for the next decision
        # (seq_id, block_id) keyed by the decision in flight: unkeyed if it fails.
        self.keyed_in_flight: list[tuple[int, int]] = []
        self._seq_ids = itertools.count(1)
        self._admit_orders = itertools.count(1)
        self.num_preemptions = 0
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    def attach_pool(self, geometry: WorkerGeometry) -> None:
        """A fresh pool and prefix cache for a worker that just said hello."""
        self.geometry = geometry
        allocator = BlockAllocator(geometry.num_kv_blocks)
        self.blocks = PrefixCache(
            allocator, geometry.block_size, enabled=self.config.prefix_caching
        )
        for request in self.waiting:
            request.block_hashes.clear()  # the new worker may use another block size

    def drop_pool(self) -> None:
        """The worker is gone with every block: running requests go back to the head of the
        queue (earliest admitted first) to be recomputed."""
        self.blocks = None
        self.keyed_in_flight = []
        self.forget_seq_ids = []
        for request in reversed(list(self.running.values())):
            request.block_ids = []
            request.num_blocks_sent = 0
            request.num_computed_tokens = 0
            request.seq_id = None
            request.state = RequestState.WAITING
            self.waiting.push_front(request)
        self.running.clear()
        self.prefilling.clear()

    def start_sequence(self, request: Request, block_ids: list[int], num_cached_tokens: int) -> int:
        """`request` runs as a new sequence owning `block_ids` (prefix hits first, already
        acquired); returns its seq_id."""
        seq_id = next(self._seq_ids)
        request.seq_id = seq_id
        request.state = RequestState.RUNNING
        request.block_ids = block_ids
        request.num_blocks_sent = 0
        request.num_computed_tokens = num_cached_tokens
        request.admit_order = next(self._admit_orders)
        request.set_steady_window(self.geometry.eos_token_ids, self.geometry.max_context_tokens)
        if request.num_cached_prompt_tokens is None:
            request.num_cached_prompt_tokens = min(num_cached_tokens, request.num_prompt_tokens)
            if self.config.prefix_caching:
                self.num_prefix_query_tokens += request.num_prompt_tokens
                self.num_prefix_hit_tokens += request.num_cached_prompt_tokens
        self.running[seq_id] = request
        return seq_id

    def release_sequence(self, request: Request, *, worker_knows: bool = True) -> None:
        """End the request's sequence: its blocks are released and the worker told to
        forget it (unless the worker already did)."""
        seq_id = request.seq_id
        assert seq_id is not None and self.blocks is not None
        self.blocks.release(request.block_ids)
        request.block_ids = []
        request.num_blocks_sent = 0
        request.num_computed_tokens = 0
        request.seq_id = None
        del self.running[seq_id]
        self.prefilling.pop(seq_id, None)
        if worker_knows:
            self.forget_seq_ids.append(seq_id)

    def preempt(self, request: Request) -> None:
        """Recompute later: blocks released, back to the head of the queue."""
        self.release_sequence(request)
        request.state = RequestState.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)

    def requeue(self, seq_ids: Sequence[int], *, worker_knows: bool) -> None:
        """Sequences of a failed step go back to the head of the queue, in plan order."""
        for seq_id in reversed(seq_ids):
            request = self.running.get(seq_id)
            if request is not None:
                self.release_sequence(request, worker_knows=worker_knows)
                request.state = RequestState.WAITING
                self.waiting.push_front(request)

    def unkey(self, keyed: list[tuple[int, int]]) -> None:
        """Drop the prefix keys of blocks whose K/V a failed step never wrote."""
        assert self.blocks is not None
        for _, block_id in keyed:
            self.blocks.unregister(block_id)

    def take_keyed_in_flight(self) -> list[tuple[int, int]]:
        keyed, self.keyed_in_flight = self.keyed_in_flight, []
        return keyed
