"""Planning one step: which sequences are fed how many tokens, with which new blocks.

The step's token budget goes to decodes first (one token per running sequence,
round-robin under a cap), then to prefill: partial prompts continue their chunks before
new requests are admitted by the configured policy. With decode_first off the order is
reversed. A sequence that needs a block when none is free preempts the most recently
admitted one (see preemption.py), and that step admits nothing new; a request is never
fed twice in one step.
"""

from __future__ import annotations

import bisect
from operator import attrgetter

from pagoda.scheduler_svc.core.admission import (
    AdmissionBudget,
    LazyCosts,
    WaitingCost,
    is_fifo_round,
    prefill_cost,
    run_policy,
)
from pagoda.scheduler_svc.core.plan_columns import feed, feed_decodes
from pagoda.scheduler_svc.core.preemption import pick_victim
from pagoda.scheduler_svc.core.prefix_cache import extend_block_hashes
from pagoda.scheduler_svc.core.request import Request, RequestState
from pagoda.scheduler_svc.core.sequence_state import SequenceState
from pagoda.scheduler_svc.core.step_decision import NewSequenceSpec, StepDecision

_RUNNING = RequestState.RUNNING
_admit_order_of = attrgetter("admit_order")
_priority_then_admission = attrgetter("priority", "admit_order")


class StepPlanner:
    def __init__(self, state: SequenceState) -> None:
        self._state = state
        self._config = state.config
        self._num_admission_rounds = 0
        self._decode_cursor = 0  # admit_order of the last sequence decoded under a cap
        self._num_preemptions_before = 0  # the count when the step being planned began
        # Decoders are fed in the reverse of preemption order, so a victim is never one
        # already fed: oldest admission first (priority: lowest value, then oldest).
        self._feed_order = _priority_then_admission if state.by_priority else _admit_order_of

    def plan(self, step_id: int, now: float) -> StepDecision:
        """The decision for step `step_id`; it may feed nothing (the caller then skips it)."""
        config = self._config
        decision = StepDecision(step_id=step_id)
        self._num_preemptions_before = self._state.num_preemptions
        budget = config.max_num_batched_tokens
        step_prefill_tokens = min(budget, config.prefill_max_tokens or budget)
        if config.decode_first:
            num_decode = self._schedule_decodes(decision, budget)
            prefill_left = min(budget - num_decode, step_prefill_tokens)
            self._schedule_prefills(decision, prefill_left, step_prefill_tokens, now)
        else:
            num_prefill = self._schedule_prefills(
                decision, step_prefill_tokens, step_prefill_tokens, now
            )
            self._schedule_decodes(decision, budget - num_prefill)
        return decision

    # -- decode --------------------------------------------------------------------------

    def _schedule_decodes(self, decision: StepDecision, num_tokens: int) -> int:
        """One token for each decoding sequence (round-robin under a cap); tokens used."""
        state = self._state
        running = state.running
        if num_tokens <= 0 or not running:
            return 0
        prefilling = state.prefilling
        if prefilling:
            decoders = [request for seq_id, request in running.items() if seq_id not in prefilling]
        else:
            decoders = list(running.values())
        cap = min(num_tokens, self._config.max_decode_batch_size or num_tokens)
        if len(decoders) > cap:
            decoders = self._round_robin(decoders, cap)
        elif state.by_priority:
            decoders.sort(key=self._feed_order)
        step_id = decision.step_id
        blocks = state.blocks
        block_size = blocks.block_size
        # The hot loop: a few attribute reads per sequence; columns are built after it.
        # A sequence that crosses into a new block is promised one of the `available`
        # blocks and gets it in one allocation after the loop; only when none is left
        # does one block at a time come from _grow, which may preempt.
        fed: list[Request] = []
        positions: list[int] = []
        growing: list[Request] = []
        grown_indices: list[int] = []  # in fed
        completing: list[int] = []  # in fed: those whose token fills their last block
        # The slot that completes a block, when completed blocks are keyed (-1: never).
        last_slot = block_size - 1 if self._config.prefix_caching else -1
        available = blocks.num_available_blocks
        capped = len(decoders) > cap
        # A decoder may have been preempted by an earlier one of this loop, or admitted
        # earlier in this step (decode_first off): only then is the check needed.
        careful = not self._config.decode_first
        for request in decoders:
            if capped and len(fed) == cap:
                break
            if careful and (
                request.state is not _RUNNING or request.last_scheduled_step == step_id
            ):
                continue
            position = request.num_computed_tokens
            slot = position % block_size
            # A table holds exactly the blocks its computed tokens fill, so a new one is
            # needed at each block boundary (known without touching the table).
            if not slot:
                if available:
                    available -= 1
                    growing.append(request)
                else:
                    self._give_blocks(growing)  # promises first: _grow may preempt
                    growing = []
                    num_preemptions = state.num_preemptions
                    grown = self._grow(request, step_id)
                    careful = careful or state.num_preemptions != num_preemptions
                    available = blocks.num_available_blocks
                    if not grown:
                        continue  # it preempted itself
                grown_indices.append(len(fed))
            if slot == last_slot:
                completing.append(len(fed))
            request.last_scheduled_step = step_id
            request.num_computed_tokens = position + 1
            fed.append(request)
            positions.append(position)
        self._give_blocks(growing)
        if fed:
            feed_decodes(state, decision, fed, positions, grown_indices, completing)
        decision.num_decode_tokens += len(fed)
        return len(fed)

    def _give_blocks(self, requests: list[Request]) -> None:
        """One new block for each of `requests`, in one allocation (they were counted)."""
        if requests:
            block_ids = self._state.blocks.allocate(len(requests))
            assert block_ids is not None
            for request, block_id in zip(requests, block_ids, strict=True):
                request.block_ids.append(block_id)

    def _round_robin(self, decoders: list[Request], cap: int) -> list[Request]:
        """Decoders in the order to try under a cap: the `cap` after the last one served
        (decoders come in admission order), then the rest in case some are preempted."""
        start = bisect.bisect_right(decoders, self._decode_cursor, key=_admit_order_of)
        rotated = decoders[start:] + decoders[:start]
        chosen, rest = rotated[:cap], rotated[cap:]
        self._decode_cursor = chosen[-1].admit_order
        chosen.sort(key=self._feed_order)
        return chosen + rest

    # -- prefill and admission -------------------------------------------------------------

    def _schedule_prefills(
        self, decision: StepDecision, num_tokens: int, step_prefill_tokens: int, now: float
    ) -> int:
        """Continue partial prefills, then admit from the waiting queue; tokens used."""
        used = 0
        step_id = decision.step_id
        for request in list(self._state.prefilling.values()):
            if used >= num_tokens:
                break
            if request.state is not _RUNNING or request.last_scheduled_step == step_id:
                continue
            wanted = min(request.num_tokens_to_feed, num_tokens - used)
            num_fed = self._fit_chunk(request, wanted, step_id)
            if num_fed:
                feed(self._state, decision, request, num_fed)
                used += num_fed
        # A step that had to preempt admits nothing: new work would only be preempted
        # next, and the budget it leaves lets the running requests move (no livelock).
        if self._state.num_preemptions == self._num_preemptions_before:
            used += self._admit(decision, num_tokens - used, step_prefill_tokens, now)
        decision.num_prefill_tokens += used
        return used

    def _admit(
        self, decision: StepDecision, num_tokens: int, step_prefill_tokens: int, now: float
    ) -> int:
        """Admission rounds until one admits nothing: a later round sees the prefix blocks
        an earlier one keyed, so identical prompts are computed once."""
        config, state = self._config, self._state
        blocks, waiting = state.blocks, state.waiting
        batch_cap = config.prefill_max_batch_size or config.max_active_requests
        used = num_admitted = 0
        first_round = True
        while waiting:
            num_requests = min(
                batch_cap - num_admitted, config.max_active_requests - len(state.running)
            )
            tokens_left = num_tokens - used
            # Without chunked prefill an oversize head may still go alone on 0 tokens left.
            if num_requests <= 0 or (
                tokens_left <= 0 and (config.chunked_prefill or not first_round)
            ):
                break
            policy = config.admission_policy
            if first_round:
                self._num_admission_rounds += 1
                if is_fifo_round(self._num_admission_rounds, config.force_fifo_every):
                    policy = "fifo"
            window = waiting.head(config.admission_lookahead if policy == "pack" else num_requests)
            budget = AdmissionBudget(
                num_tokens=tokens_left,
                num_step_tokens=step_prefill_tokens,
                num_requests=num_requests,
                num_blocks=blocks.num_available_blocks,
                block_size=blocks.block_size,
                chunked_prefill=config.chunked_prefill,
                first_round=first_round,
            )
            admitted = []
            costs = LazyCosts(window, self._price)
            for admission in run_policy(policy, costs, budget, config.admission_lookahead):
                num_fed = self._start(decision, window[admission.index], admission.num_tokens, now)
                if num_fed == 0:
                    break
                admitted.append(admission.index)
                used += num_fed
            if not admitted:
                break
            waiting.remove_head_indices(admitted)
            num_admitted += len(admitted)
            first_round = False
        return used

    def _price(self, request: Request) -> WaitingCost:
        blocks = self._state.blocks
        hit_block_ids = self._match(request)
        num_cached_tokens = len(hit_block_ids) * blocks.block_size
        return WaitingCost(
            num_tokens=prefill_cost(
                len(request.token_ids), num_cached_tokens, self._state.geometry.max_context_tokens
            ),
            num_reclaimed_blocks=blocks.num_evictable(hit_block_ids),
            priority=request.priority,
        )

    def _match(self, request: Request) -> list[int]:
        """Cached blocks of the request's prefix; the last token is always left to compute
        so there are logits to sample."""
        blocks = self._state.blocks
        if not blocks.enabled:
            return []
        max_blocks = (len(request.token_ids) - 1) // blocks.block_size
        extend_block_hashes(request.token_ids, request.block_hashes, max_blocks, blocks.block_size)
        return blocks.match(request.block_hashes, max_blocks)

    def _start(self, decision: StepDecision, request: Request, num_tokens: int, now: float) -> int:
        """Admit `request` as a new sequence feeding up to `num_tokens`. Returns the tokens
        fed; 0 when it no longer fits (a prefix block it counted on was evicted since)."""
        blocks = self._state.blocks
        block_size = blocks.block_size
        hit_block_ids = self._match(request)
        num_cached_tokens = len(hit_block_ids) * block_size
        num_to_feed = len(request.token_ids) - num_cached_tokens
        num_tokens = min(num_tokens, num_to_feed)
        if num_tokens < num_to_feed and not self._config.chunked_prefill:
            return 0
        num_new_blocks = -(-num_tokens // block_size)
        if blocks.num_available_blocks - blocks.num_evictable(hit_block_ids) < num_new_blocks:
            return 0
        blocks.acquire(hit_block_ids)  # first, so allocating cannot evict them
        new_block_ids = blocks.allocate(num_new_blocks)
        assert new_block_ids is not None
        seq_id = self._state.start_sequence(
            request, hit_block_ids + new_block_ids, num_cached_tokens
        )
        if request.first_scheduled_s is None:
            request.first_scheduled_s = now
        decision.new_sequences.append(
            NewSequenceSpec(
                seq_id=seq_id,
                sampling=request.sampling,
                cached_token_ids=request.token_ids[:num_cached_tokens].tolist(),
                num_prompt_tokens=request.num_prompt_tokens,
            )
        )
        feed(self._state, decision, request, num_tokens)
        return num_tokens

    # -- blocks and columns ----------------------------------------------------------------

    def _fit_chunk(self, request: Request, num_tokens: int, step_id: int) -> int:
        """Blocks for the next `num_tokens` of a partial prefill; the chunk shrinks to the
        blocks there are. 0 when the request had to preempt itself."""
        blocks = self._state.blocks
        block_size = blocks.block_size
        start = request.num_computed_tokens
        num_new_blocks = -(-(start + num_tokens) // block_size) - len(request.block_ids)
        if num_new_blocks > 0:
            if blocks.num_available_blocks == 0:
                if not self._grow(request, step_id):
                    return 0
                num_new_blocks -= 1
            num_taken = min(num_new_blocks, blocks.num_available_blocks)
            if num_taken:
                request.block_ids.extend(blocks.allocate(num_taken))
        return min(num_tokens, len(request.block_ids) * block_size - start)

    def _grow(self, request: Request, step_id: int) -> bool:
        """Append one block to a running request's table, preempting others while none is
        available. False when the request itself was the victim."""
        state = self._state
        blocks = state.blocks
        while blocks.num_available_blocks == 0:
            victim = pick_victim(reversed(state.running.values()), step_id, state.by_priority)
            assert victim is not None  # the requester itself is always a candidate
            state.preempt(victim)
            if victim is request:
                return False
        request.block_ids.extend(blocks.allocate(1))
        return True
