"""The plan under construction: one step's columns, and what building them keys and owes.

The planner decides who is fed how many tokens and with which blocks; a PlanBuilder puts
that in the plan's columns (StepPlan: parallel lists, ragged runs by offsets), advances
each fed request's counters, keys for the prefix cache the blocks the step completes, and
can take an entry out again (`unfeed`: a priority preemption of a request already fed).
One builder per plan; its state ends with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.common.step import NewSequence, StepPlan
from pagoda.scheduler_svc.core.kv import PrefixCache, extend_block_hashes
from pagoda.scheduler_svc.core.request import Request, RequestState

# Shared int objects for token offsets: a decode step's offsets would otherwise allocate
# one new int per sequence. Only grows.
_counting_numbers: list[int] = []


@dataclass(slots=True)
class BuiltPlan:
    """A finished plan, with what the scheduler keeps while its step is in flight."""

    plan: StepPlan
    # (seq_id, block_id) the plan keyed for the prefix cache: unkeyed if the step fails.
    keyed: list[tuple[int, int]]
    # (request, position) of its decodes fed ahead of their token (PlanBuilder.ahead).
    ahead: list[tuple[Request, int]]


class PlanBuilder:
    def __init__(
        self,
        step_id: int,
        blocks: PrefixCache,
        *,
        prefix_caching: bool,
        only: dict[str, Request] | None = None,
    ) -> None:
        self.plan = StepPlan(step_id=step_id)
        self.step_id = step_id
        self.blocks = blocks
        # The only requests this plan may feed (by request id), or None: all (isolation.py).
        self.only = only
        # (seq_id, block_id) this plan keyed: unkeyed if the step fails.
        self.keyed: list[tuple[int, int]] = []
        # (request, position) of the decodes fed ahead of their token (overlapped steps):
        # the step in flight samples it, the worker feeds it (StepPlan.last_sampled_rows).
        self.ahead: list[tuple[Request, int]] = []
        self._prefix_caching = prefix_caching
        # Entries [start, end) of the plan are its decodes (an un-fed one is taken out).
        self._decode_entries = (0, 0)

    def build(self) -> BuiltPlan:
        """The plan, its token counts set, with its keys and ahead decodes. Every entry is
        a decode or a prefill; counted at the end since a preemption under the priority
        policy may take one out (unfeed)."""
        plan = self.plan
        plan.num_prefill_tokens = plan.num_tokens - plan.num_decode_tokens - plan.num_draft_tokens
        return BuiltPlan(plan, self.keyed, self.ahead)

    def start(
        self, request: Request, seq_id: int, hit_block_ids: list[int], num_new_blocks: int
    ) -> None:
        """Start `request` (its stop rules set) as sequence `seq_id` on its prefix hits and
        `num_new_blocks` new blocks (counted available), named to the worker in the plan;
        feed it next."""
        blocks = self.blocks
        blocks.acquire(hit_block_ids)  # first, so allocating cannot evict them
        new_block_ids = blocks.allocate(num_new_blocks)
        assert new_block_ids is not None
        num_cached_tokens = len(hit_block_ids) * blocks.block_size
        request.seq_id = seq_id
        request.state = RequestState.RUNNING
        request.admit_step = self.step_id
        request.block_ids = hit_block_ids + new_block_ids
        request.num_blocks_sent = 0
        request.num_computed_tokens = num_cached_tokens
        # The worker masks the stop ids until min_new_tokens (check_stop never sees one).
        masked = bool(request.stop_token_ids) and (
            request.num_generated_tokens < request.stopping.min_new_tokens
        )
        self.plan.new_sequences.append(
            NewSequence(
                seq_id=seq_id,
                sampling=request.sampling,
                cached_token_ids=request.token_ids[:num_cached_tokens].tolist(),
                num_prompt_tokens=request.num_prompt_tokens,
                min_new_tokens=request.stopping.min_new_tokens if masked else 0,
                min_tokens_banned_ids=request.stop_token_ids if masked else frozenset(),
            )
        )

    def feed(self, request: Request, num_tokens: int) -> None:
        """Put the request's next `num_tokens` tokens, and its unsent blocks, in the plan."""
        plan = self.plan
        start = request.num_computed_tokens
        end = start + num_tokens
        token_ids = request.token_ids
        self._append_row(request, start, end == len(token_ids), token_ids[start:end])
        if plan.draft_counts:
            plan.draft_counts.append(0)
        request.num_computed_tokens = end
        request.last_scheduled_step = self.step_id
        if self._prefix_caching or request.shares_prompt:
            key_blocks(self.blocks, request, start, end, self.keyed)

    def feed_drafted(self, request: Request, position: int, drafts: list[int]) -> None:
        """A decoding request's row: its last token, known, at `position` (its counters
        advanced already), then `drafts` (speculation.py), which its table has room for.
        It samples len(drafts) + 1 tokens; none of its blocks is keyed before they are
        known (Scheduler.apply keys what the accepted drafts complete). Called after the
        plan's other decodes, before its prompt chunks."""
        plan = self.plan
        index = len(plan.seq_ids)
        if not plan.draft_counts:
            plan.draft_counts.extend([0] * index)
        plan.draft_counts.append(len(drafts))
        self._append_row(request, position, True, [request.token_ids[position], *drafts])
        plan.num_decode_tokens += 1  # its drafts are counted apart (StepPlan.draft_counts)
        first, last = self._decode_entries
        self._decode_entries = (first if last == index and last > first else index, index + 1)

    def _append_row(
        self, request: Request, start: int, sample: bool, token_ids: Sequence[int]
    ) -> None:
        """One row of the columns: `request`'s sequence feeds `token_ids` from position
        `start` (and samples after them when `sample`), with the blocks of its table not
        sent yet."""
        plan = self.plan
        plan.seq_ids.append(request.seq_id)
        plan.start_positions.append(start)
        plan.sample.append(sample)
        plan.token_ids.extend(token_ids)
        plan.token_offsets.append(len(plan.token_ids))
        table = request.block_ids
        plan.block_ids.extend(table[request.num_blocks_sent :])
        plan.block_offsets.append(len(plan.block_ids))
        request.num_blocks_sent = len(table)

    def give_blocks(self, requests: list[Request]) -> None:
        """One new block for each of `requests` (decoders at a block boundary, promised
        blocks that are available), in one allocation."""
        if requests:
            block_ids = self.blocks.allocate(len(requests))
            assert block_ids is not None
            for request, block_id in zip(requests, block_ids, strict=True):
                request.block_ids.append(block_id)

    def feed_decodes(
        self,
        fed: list[Request],
        positions: list[int],
        grown_indices: list[int],
        completing: list[int],
    ) -> None:
        """The columns of decoding sequences `fed`, each feeding its last token at
        `positions[i]`. Their counters are advanced already, and those at `grown_indices`
        (ascending) got a new block; the others have sent their whole table. Those at
        `completing` fill their last block: it is keyed for the prefix cache. Called once
        per plan.

        The hot path: comprehensions rather than one append per column per sequence; only
        the 1/block_size that grew or complete a block are visited one by one.
        """
        plan = self.plan
        num_fed = len(fed)
        first_entry = len(plan.seq_ids)
        plan.seq_ids.extend([request.seq_id for request in fed])
        plan.start_positions.extend(positions)
        plan.sample.extend([True] * num_fed)
        token_ids = plan.token_ids
        base = len(token_ids)
        token_ids.extend([request.token_ids[-1] for request in fed])
        stop = base + num_fed + 1
        numbers = _counting_numbers
        if stop > len(numbers):
            numbers.extend(range(len(numbers), 2 * stop))
        plan.token_offsets.extend(numbers[base + 1 : stop])
        block_ids, block_offsets = plan.block_ids, plan.block_offsets
        done = 0
        for index in grown_indices:
            block_offsets.extend([len(block_ids)] * (index - done))
            request = fed[index]
            table = request.block_ids
            block_ids.extend(table[request.num_blocks_sent :])
            request.num_blocks_sent = len(table)
            block_offsets.append(len(block_ids))
            done = index + 1
        block_offsets.extend([len(block_ids)] * (num_fed - done))
        for index in completing:
            position = positions[index]
            key_blocks(self.blocks, fed[index], position, position + 1, self.keyed)
        plan.num_decode_tokens += num_fed
        if num_fed:
            self._decode_entries = (first_entry, len(plan.seq_ids))

    def may_unfeed(self, request: Request) -> bool:
        """Whether `request`, fed in this plan, can be taken out of it: its entry is in the
        columns (not a decode still being gathered) and no other sequence of the step
        shares a block it keys (that one would read nothing)."""
        if request.seq_id not in self.plan.seq_ids:
            return False
        ref_count = self.blocks.allocator.ref_count
        return all(
            ref_count(block_id) == 1 for seq_id, block_id in self.keyed if seq_id == request.seq_id
        )

    def unfeed(self, request: Request) -> bool:
        """Take `request`'s entry out of the plan (see may_unfeed) and drop the keys it made.
        Returns whether the worker knows its sequence (else it was new in this plan and is
        dropped from it too)."""
        plan = self.plan
        seq_id = request.seq_id
        index = plan.seq_ids.index(seq_id)
        for ids, offsets in (
            (plan.token_ids, plan.token_offsets),
            (plan.block_ids, plan.block_offsets),
        ):
            start, end = offsets[index], offsets[index + 1]
            del ids[start:end]
            offsets[index + 1 :] = [offset - (end - start) for offset in offsets[index + 2 :]]
        del plan.seq_ids[index], plan.start_positions[index], plan.sample[index]
        if plan.draft_counts:
            del plan.draft_counts[index]
        first, last = self._decode_entries
        if first <= index < last:
            plan.num_decode_tokens -= 1
        if index < last:
            self._decode_entries = (first - (index < first), last - 1)
        for block_id in [block_id for s, block_id in self.keyed if s == seq_id]:
            self.blocks.unregister(block_id)
        self.keyed = [entry for entry in self.keyed if entry[0] != seq_id]
        news = plan.new_sequences
        for position, new in enumerate(news):
            if new.seq_id == seq_id:
                del news[position]
                return False
        return True


def key_blocks(
    blocks: PrefixCache,
    request: Request,
    start: int,
    end: int,
    keyed: list[tuple[int, int]],
) -> None:
    """Key the blocks that positions [start, end) of `request` complete, appending each
    (seq_id, block_id) keyed to `keyed`: the worker writes them before any read in the step
    that feeds them, so a later admission of that step may share them."""
    block_size = blocks.block_size
    first, last = start // block_size, end // block_size
    if first == last:
        return
    extend_block_hashes(
        request.token_ids, request.block_hashes, last, block_size, request.cache_root_hash
    )
    for index in range(first, last):
        block_id = request.block_ids[index]
        if blocks.register(block_id, request.block_hashes[index], always=request.shares_prompt):
            keyed.append((request.seq_id, block_id))
