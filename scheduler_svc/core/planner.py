"""The planner: who waits, who runs with which KV blocks, and what each step feeds.

It owns the waiting queue, the running set (running.py) and the KV pool, and is, with
the PlanBuilder of the plan it builds (plan_builder.py: the columns), the only writer of
a Request's sequence fields (see Request). Every block a sequence holds is released in
`release`, the one path used by finish, preemption and requeue after a failed step.

A step's token budget goes to decodes first (one token per running sequence, round-robin
under a cap), then to prefill: partial prompts continue their chunks before new requests
are admitted by the configured policy (admission.py). With decode_first off the order is
reversed, and prefill then leaves one block to each decoder at a block boundary that it
would be preempted for (for an admission, every one). One exception to decodes first: a head
that a forced FIFO round could not fit (reserved, unchunked) gets its tokens before the
decodes of the next step when it fits a step alone, so it waits one step, not for the
running set to drain. A chunk that finds the pool empty feeds what its last block still
holds. Feeding a request advances its num_computed_tokens at once: the step in flight
counts as computed (a failed step requeues its sequences). A request is never fed twice
in one step.

Preemption is by recompute: a sequence that needs a block when none is available takes
one from the most recently admitted (preemption.py), whose blocks are released (its full
blocks stay in the prefix cache, so the recompute is mostly hits) and who goes back to
the head of the waiting queue. Under the priority policy the victim is the lowest
priority, then the most recently admitted, even one already fed in the plan being built:
its entry is taken out again (PlanBuilder.unfeed), as vLLM v1 does. A step that preempted
admits nothing new, so an admission never costs an older request its blocks.

Tenants (tenants.py): while two tenants or more have work, each admission round admits
one request of the least-served waiting tenant (by its policy, within its own queue),
partial prefills continue least-served first (those of tenants served as much as that
tenant or more after its round: `_split_at_neediest_head`), victims come from the
most-served tenant first, and every token fed is charged to its tenant; before each plan,
the least-served waiting tenant may preempt requests of tenants above their share to
start (preempt to admit, tenants.py). Otherwise none of this runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagoda.common.step import WorkerGeometry
from pagoda.scheduler_svc.core.admission import (
    AdmissionBudget,
    LazyCosts,
    WaitingCost,
    admission_window,
    is_fifo_round,
    room_for_reserved_head,
    run_policy,
    waiting_cost,
)
from pagoda.scheduler_svc.core.config import SchedulerConfig
from pagoda.scheduler_svc.core.kv import BlockAllocator, PrefixCache, match_request
from pagoda.scheduler_svc.core.plan_builder import BuiltPlan, PlanBuilder
from pagoda.scheduler_svc.core.preemption import choose_victim
from pagoda.scheduler_svc.core.request import Request, RequestState, set_stop_rules
from pagoda.scheduler_svc.core.running import RunningSet
from pagoda.scheduler_svc.core.speculation import (
    acceptance,
    draft_price,
    num_worth_drafting,
    pause_drafts,
    propose,
)
from pagoda.scheduler_svc.core.step_budget import StepCostModel
from pagoda.scheduler_svc.core.tenants import (
    Ledger,
    admission_shortage,
    admission_victims,
    by_least_served,
    neediest_tenant,
    neediness,
)
from pagoda.scheduler_svc.core.waiting_queue import WaitingQueue, still_waiting

_RUNNING = RequestState.RUNNING
_WAITING = RequestState.WAITING


class Planner:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.by_priority = config.admission_policy == "priority"
        # The last worker's geometry; kept while detached so add() can still refuse.
        self.geometry: WorkerGeometry | None = None
        self.blocks: PrefixCache | None = None  # None while no worker is attached
        self.waiting = WaitingQueue(by_priority=self.by_priority, by_tenant=config.fair_share)
        # Each tenant's weighted service; consulted only while `tenants.fair` (two or more).
        self.tenants = Ledger(
            enabled=config.fair_share,
            prompt_weight=config.fair_prompt_weight,
            generated_weight=config.fair_generated_weight,
        )
        self.sequences = RunningSet(self.by_priority)
        self.forget_seq_ids: list[int] = []  # for the next plan
        # (seq_id, request) of each sequence preempted since the last take_victims().
        self._victims: list[tuple[int, Request]] = []
        self._seq_ids = itertools.count(1)
        self._admit_orders = itertools.count(1)
        self.num_preemptions = 0
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self._num_admission_rounds = 0
        # The head a forced FIFO round could not fit: admitted before anything else.
        self._reserved_head: Request | None = None
        # The step budget's cost model (the Scheduler's), which prices drafts; None: off.
        self.cost_model: StepCostModel | None = None
        # Drafts per decoding request with the attached worker (attach_pool); 0: none.
        self.speculative_tokens = 0

    @property
    def running(self) -> dict[int, Request]:
        """seq_id -> request, in admission order (RunningSet.requests)."""
        return self.sequences.requests

    @property
    def prefilling(self) -> dict[int, Request]:
        """The running ones with tokens left to feed before their next sample."""
        return self.sequences.prefilling

    # -- the pool and the sequences ------------------------------------------------------

    def attach_pool(self, geometry: WorkerGeometry, *, overlapped: bool = False) -> None:
        """A fresh pool and prefix cache for a worker that just said hello (its steps
        `overlapped`: planned ahead of the one in flight), and its speculation."""
        self.geometry = geometry
        self.speculative_tokens = self.config.speculative_tokens_for(
            batch_invariant=geometry.batch_invariant, overlapped=overlapped
        )
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
        self.forget_seq_ids = []
        for request in reversed(list(self.running.values())):
            self.sequences.end(request)
            request.state = _WAITING
            self.waiting.push_front(request)

    def release(self, request: Request, *, worker_knows: bool = True) -> None:
        """End the request's sequence: its blocks are released and the worker told to
        forget it (unless the worker already did)."""
        seq_id = request.seq_id
        assert seq_id is not None and self.blocks is not None
        self.blocks.release(request.block_ids)
        self.sequences.end(request)
        if worker_knows:
            self.forget_seq_ids.append(seq_id)

    def finish(self, request: Request) -> None:
        """The request is done: out of the queue or its sequence released."""
        if request.state is _RUNNING:
            self.release(request)
        elif request.state is _WAITING:
            self.waiting.remove(request)
        request.state = RequestState.FINISHED

    def preempt(self, request: Request, *, worker_knows: bool = True) -> None:
        """Recompute later: blocks released, back to the head of the queue."""
        self._victims.append((request.seq_id, request))
        self.release(request, worker_knows=worker_knows)
        request.state = _WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.tenants.account(request.tenant).num_preemptions += 1
        self.waiting.push_front(request)

    def requeue(self, seq_ids: Sequence[int], *, worker_knows: bool) -> None:
        """Sequences of a failed step go back to the head of the queue, in plan order."""
        for seq_id in reversed(seq_ids):
            request = self.running.get(seq_id)
            if request is not None:
                self.release(request, worker_knows=worker_knows)
                request.state = _WAITING
                self.waiting.push_front(request)

    def take_forget_seq_ids(self) -> list[int]:
        forget, self.forget_seq_ids = self.forget_seq_ids, []
        return forget

    def take_victims(self) -> list[tuple[int, Request]]:
        """(seq_id, request) of the sequences preempted since the last call (planning)."""
        victims, self._victims = self._victims, []
        return victims

    # -- planning --------------------------------------------------------------------------

    def plan(
        self,
        step_id: int,
        now: float,
        only: Iterable[Request] | None = None,
        max_prefill_tokens: int | None = None,
    ) -> BuiltPlan:
        """The plan for step `step_id`; it may feed nothing (the caller then skips it).

        With `only`, the plan feeds those requests alone (admitted, continued or decoded,
        within the same budgets and caps) and preempts none but them (isolation.py).
        `max_prefill_tokens` (the step budget's cap, step_budget.py) lowers the prompt
        tokens of this step below the fixed knobs; without chunked prefill a prompt above
        it still goes alone (admission's oversize head), so none waits forever.
        """
        config = self.config
        b = PlanBuilder(
            step_id,
            self.blocks,
            prefix_caching=config.prefix_caching,
            only={request.request_id: request for request in only} if only is not None else None,
        )
        if self.tenants.fair and only is None:
            for victim in self._admission_victims(step_id):
                self.preempt(victim)  # before the count: this step still admits
        num_preemptions = self.num_preemptions
        budget = config.max_num_batched_tokens
        step_prefill_tokens = min(budget, config.prefill_max_tokens or budget)
        if max_prefill_tokens is not None:
            step_prefill_tokens = min(step_prefill_tokens, max_prefill_tokens)
        if config.decode_first:
            room = self._room_for_reserved_head(b, step_prefill_tokens)
            num_decode = self._schedule_decodes(b, budget - room)
            prefill_left = min(budget - num_decode, step_prefill_tokens)
            self._schedule_prefills(b, prefill_left, step_prefill_tokens, now, num_preemptions)
        else:
            num_prefill = self._schedule_prefills(
                b, step_prefill_tokens, step_prefill_tokens, now, num_preemptions
            )
            self._schedule_decodes(b, budget - num_prefill)
        return b.build()

    def _room_for_reserved_head(self, b: PlanBuilder, step_prefill_tokens: int) -> int:
        """Tokens the decodes leave for the reserved head (admission.room_for_reserved_head)."""
        head = self._reserved_head
        if (
            head is None
            or head.state is not _WAITING
            or b.only is not None
            or self.config.chunked_prefill
            or len(self.running) >= self.config.max_active_requests
        ):
            return 0
        num_free_blocks = self.blocks.num_available_blocks - len(self.running)
        return room_for_reserved_head(
            self._price(head), step_prefill_tokens, num_free_blocks, self.blocks.block_size
        )

    # -- decode ----------------------------------------------------------------------------

    def _schedule_decodes(self, b: PlanBuilder, num_tokens: int) -> int:
        """One token for each decoding sequence (round-robin under a cap); tokens used."""
        if num_tokens <= 0 or not self.running:
            return 0
        cap = min(num_tokens, self.config.max_decode_batch_size or num_tokens)
        decoders = self.sequences.to_decode(b.only, cap)
        step_id = b.step_id
        blocks = self.blocks
        block_size = blocks.block_size
        # The hot loop: a few attribute reads per sequence; columns are built after it.
        # A sequence that crosses into a new block is promised one of the `available`
        # blocks and gets it in one allocation after the loop; only when none is left
        # does one block at a time come from _grow, which may preempt.
        fed: list[Request] = []
        positions: list[int] = []
        # Decoders whose token is known, fed with drafts after the loop (speculation.py):
        # only while no prompt is to be computed (one prefilling, or one waiting with a
        # free slot), since a draft takes a prompt token's place and time.
        drafting: list[tuple[Request, int]] = []
        config = self.config
        speculates = (
            bool(self.speculative_tokens)
            and min(cap, len(decoders)) <= config.speculative_max_batch
            and not self.sequences.prefilling
            and (not self.waiting or len(self.running) >= config.max_active_requests)
        )
        growing: list[Request] = []
        grown_indices: list[int] = []  # in fed
        completing: list[int] = []  # in fed: those whose token fills their last block
        # The slot that completes a block, when completed blocks are keyed (-1: never).
        last_slot = block_size - 1 if self.config.prefix_caching else -1
        available = blocks.num_available_blocks
        capped = len(decoders) > cap
        # A decoder may have been preempted by an earlier one of this loop, or admitted
        # earlier in this step (decode_first off): only then is the check needed.
        careful = not self.config.decode_first
        for request in decoders:
            if capped and len(fed) + len(drafting) == cap:
                break
            if careful and (
                request.state is not _RUNNING or request.last_scheduled_step == step_id
            ):
                continue
            position = request.num_computed_tokens
            num_known = len(request.token_ids)
            # Its token of the step in flight is not known yet (overlapped steps): fed as
            # the worker's last sampled one, unless that token certainly ends the request.
            # (A grammar's mask for the next one follows the plan: scheduler_svc.grammars.)
            if position == num_known and position + 1 >= request.max_num_tokens:
                continue
            slot = position % block_size
            # A table holds exactly the blocks its computed tokens fill, so a new one is
            # needed at each block boundary (known without touching the table).
            if not slot:
                if available:
                    available -= 1
                    growing.append(request)
                else:
                    b.give_blocks(growing)  # promises first: _grow may preempt
                    growing = []
                    num_preemptions = self.num_preemptions
                    grown = self._grow(b, request)
                    careful = careful or self.num_preemptions != num_preemptions
                    available = blocks.num_available_blocks
                    if not grown:
                        continue  # it preempted itself
                grown_indices.append(len(fed))
            request.last_scheduled_step = step_id
            request.num_computed_tokens = position + 1
            if (
                speculates
                and position + 1 == num_known
                and slot != block_size - 1  # its table has room for a draft
            ):
                drafting.append((request, position))
                if grown_indices and grown_indices[-1] == len(fed):
                    grown_indices.pop()  # it is not in `fed`: its block goes with its row
                continue
            if position == num_known:
                b.ahead.append((request, position))  # its block is keyed once known
            elif slot == last_slot:
                completing.append(len(fed))
            fed.append(request)
            positions.append(position)
        b.give_blocks(growing)
        b.feed_decodes(fed, positions, grown_indices, completing)
        num_drafted = 0
        if drafting:
            num_decoders = len(fed) + len(drafting)
            num_context = sum(positions) + sum(position for _, position in drafting)
            price = draft_price(self.cost_model, num_decoders, num_context + num_decoders)
            num_drafted = self._feed_drafted(b, drafting, num_tokens - num_decoders, price)
        if self.tenants.fair:
            self.tenants.charge_generated([request.tenant for request in fed])
        return len(fed) + len(drafting) + num_drafted

    def _feed_drafted(
        self,
        b: PlanBuilder,
        drafting: list[tuple[Request, int]],
        num_tokens: int,
        price: float,
    ) -> int:
        """Feed each of `drafting` (a decoder whose last token, at its position, is known)
        with the drafts speculation proposes for it: those worth their `price`
        (speculation.draft_price) at its acceptance rate, as many as its table's last
        block, its length limit and `num_tokens` allow, each token charged to its tenant
        (a draft costs the worker as a token does, kept or not); drafted tokens fed. A
        constrained request whose grammar forces its next tokens drafts those instead,
        paused or not: the model is held to them (kept unless it spells them otherwise,
        so priced as kept), and what becomes of them stays out of its record."""
        config = self.config
        block_size = self.blocks.block_size
        num_drafted = 0
        for request, position in drafting:
            limit = min(
                self.speculative_tokens,
                len(request.block_ids) * block_size - position - 1,
                request.max_num_tokens - position - 2,  # the last sample may end it
                num_tokens - num_drafted,
            )
            grammar = request.grammar
            forced = grammar.forced_tokens(request) if grammar is not None and limit > 0 else []
            if forced:
                drafts = forced[: num_worth_drafting(1.0, price, limit)]
                request.forced_drafts_step = b.step_id
            else:
                worth = 0
                if limit > 0 and b.step_id >= request.drafts_resume_step:
                    rate = acceptance(request.num_kept_drafts, request.num_tried_drafts)
                    worth = num_worth_drafting(rate, price, limit)
                    if not worth:
                        pause_drafts(request, b.step_id)
                drafts = propose(
                    request.token_ids,
                    config.speculative_ngram_min,
                    config.speculative_ngram_max,
                    worth,
                )
                if drafts and grammar is not None:  # none the grammar would refuse
                    drafts = drafts[: grammar.num_allowed(request, drafts)]
            b.feed_drafted(request, position, drafts)
            num_drafted += len(drafts)
            if self.tenants.fair:
                self.tenants.charge_generated([request.tenant] * (1 + len(drafts)))
        return num_drafted

    # -- prefill and admission -------------------------------------------------------------

    def _schedule_prefills(
        self,
        b: PlanBuilder,
        num_tokens: int,
        step_prefill_tokens: int,
        now: float,
        num_preemptions_before: int,
    ) -> int:
        """Continue partial prefills, then admit from the waiting queue (unless the plan
        preempted: `num_preemptions_before` is the count when it began); tokens used."""
        only = b.only
        continuing = list(self.prefilling.values())
        if only is not None:
            continuing = [request for request in continuing if request.request_id in only]
        behind: list[Request] = []
        if self.tenants.fair:  # the chunk budget goes to the least-served tenant first
            counters = self.tenants.counters()
            continuing = by_least_served(continuing, counters)
            if continuing and only is None:
                continuing, behind = self._split_at_neediest_head(continuing, counters)
        used = self._continue_prefills(b, continuing, num_tokens)
        # A step that had to preempt admits nothing: new work would only be preempted
        # next, and the budget it leaves lets the running requests move (no livelock).
        rounds = _AdmissionRounds()
        if behind and self.num_preemptions == num_preemptions_before:
            used += self._admit(b, num_tokens - used, step_prefill_tokens, now, rounds, 1)
        used += self._continue_prefills(b, behind, num_tokens - used)
        if self.num_preemptions == num_preemptions_before:
            used += self._admit(b, num_tokens - used, step_prefill_tokens, now, rounds)
        return used

    def _split_at_neediest_head(
        self, continuing: list[Request], counters: dict[str, float]
    ) -> tuple[list[Request], list[Request]]:
        """`continuing` (least served first) as the prompts in progress that go before the
        neediest waiting tenant's head and those that go after it: the tenants served as
        much as it or more (tenants.neediest_tenant's order, ties to the waiting one), so
        that a short request of a tenant just lifted to a flood's counter is not left what
        the flood's chunks leave."""
        num_requests = self.tenants.num_requests()
        needy = neediest_tenant(self.waiting.tenant_names(), counters, num_requests)
        if needy is None:
            return continuing, []
        needy_key = neediness(needy, counters, num_requests)
        ahead: list[Request] = []
        behind: list[Request] = []
        for request in continuing:
            tenant = request.tenant
            goes_first = tenant == needy or neediness(tenant, counters, num_requests) < needy_key
            (ahead if goes_first else behind).append(request)
        return ahead, behind

    def _continue_prefills(self, b: PlanBuilder, requests: list[Request], num_tokens: int) -> int:
        """Feed the next chunks of `requests` (prompts in progress) in order, within
        `num_tokens`; tokens used."""
        used = 0
        step_id = b.step_id
        for request in requests:
            if used >= num_tokens:
                break
            if request.state is not _RUNNING or request.last_scheduled_step == step_id:
                continue
            wanted = min(request.num_tokens_to_feed, num_tokens - used)
            num_fed = self._fit_chunk(b, request, wanted)
            if num_fed:
                self._feed(b, request, num_fed)
                used += num_fed
        return used

    def _admit(
        self,
        b: PlanBuilder,
        num_tokens: int,
        step_prefill_tokens: int,
        now: float,
        rounds: _AdmissionRounds,
        max_rounds: int | None = None,
    ) -> int:
        """Admission rounds until one admits nothing (or `max_rounds` of them have): a
        later round sees the prefix blocks an earlier one keyed, so identical prompts are
        computed once. `rounds` carries the step's rounds from one call to the next. Under
        `only` only those requests are admitted."""
        config, blocks, waiting, only = self.config, self.blocks, self.waiting, b.only
        batch_cap = config.prefill_max_batch_size or config.max_active_requests
        used = 0
        # Decodes come after admission (decode_first off): the blocks they will need are
        # theirs, so an admission never makes an older request preempt in its own step.
        num_reserved_blocks = -1  # counted on first need
        num_rounds = 0
        while not rounds.ended and (still_waiting(only) if only is not None else waiting):
            if max_rounds is not None and num_rounds == max_rounds:
                break
            num_rounds += 1
            rounds.ended = True  # unless this round admits some
            first_round = rounds.first
            num_running = len(self.running)
            num_requests = min(
                batch_cap - rounds.num_admitted, config.max_active_requests - num_running
            )
            tokens_left = num_tokens - used
            # Without chunked prefill an oversize head may still go alone on 0 tokens left.
            if num_requests <= 0 or (
                tokens_left <= 0 and (config.chunked_prefill or not first_round)
            ):
                break
            if num_reserved_blocks < 0:
                num_reserved_blocks = self._num_decode_growth_blocks(b)
            num_free_blocks = blocks.num_available_blocks - num_reserved_blocks
            if num_free_blocks <= 0:
                break  # nothing can start without a block: do not price the window
            # Fair share: this round admits one request of the least-served waiting tenant.
            tenant = self.tenants.neediest(self.waiting.tenant_names()) if only is None else None
            if tenant is not None:
                num_requests = 1
            forced = False
            if first_round:
                self._num_admission_rounds += 1
                forced = is_fifo_round(self._num_admission_rounds, config.fifo_every)
            reserved = self._reserved_head
            if reserved is not None and reserved.state is not _WAITING:
                reserved = self._reserved_head = None  # it started, or ended while waiting
            policy, window = admission_window(
                waiting,
                config.admission_policy,
                num_requests,
                config.admission_lookahead,
                forced=forced,
                reserved=reserved,
                tenant=tenant,
                by_priority=self.by_priority,
                only=still_waiting(only) if only is not None else None,
            )
            budget = AdmissionBudget(
                num_tokens=tokens_left,
                num_step_tokens=step_prefill_tokens,
                num_requests=num_requests,
                num_blocks=num_free_blocks,
                block_size=blocks.block_size,
                chunked_prefill=config.chunked_prefill,
                first_round=first_round,
            )
            admitted = []
            costs = LazyCosts(window, self._price)
            for admission in run_policy(policy, costs, budget, config.admission_lookahead):
                num_fed = self._start(b, window[admission.index], admission.num_tokens, now)
                if num_fed == 0:
                    break
                admitted.append(admission.index)
                used += num_fed
            if forced and only is None and window and (not admitted or admitted[0] != 0):
                self._reserved_head = window[0]
            if not admitted:
                break
            for index in admitted:
                waiting.remove(window[index])
            rounds.num_admitted += len(admitted)
            rounds.first = rounds.ended = False
        return used

    def _admission_victims(self, step_id: int) -> list[Request]:
        """Whom to preempt so the least-served waiting tenant's head can start (tenants.py:
        preempt to admit); usually none, found without a pass over the running set."""
        counters = self.tenants.counters()
        needy = neediest_tenant(self.waiting.tenant_names(), counters, self.tenants.num_requests())
        if needy is None:
            return []
        cost = self._price(self.waiting.head(1, needy)[0])
        shortage = admission_shortage(
            needy,
            cost.num_tokens,
            cost.num_reclaimed_blocks,
            self.running.values(),
            self.blocks.num_available_blocks,
            self.blocks.block_size,
            self.config.max_active_requests,
            self.geometry.num_kv_blocks,
            self.tenants.accounts,
        )
        if shortage is None:
            return []
        return admission_victims(shortage, reversed(self.running.values()), counters, step_id)

    def _num_decode_growth_blocks(self, b: PlanBuilder, before: Request | None = None) -> int:
        """Blocks the decodes still to plan in this step need: one for each running
        decoder at a block boundary (with `before`, those it would be preempted for:
        earlier in feed order). 0 when decodes were planned first (or under `only`)."""
        if self.config.decode_first or b.only is not None:
            return 0
        return self.sequences.num_at_block_boundary(self.blocks.block_size, b.step_id, before)

    def _price(self, request: Request) -> WaitingCost:
        """The request as admission sees it (admission.waiting_cost)."""
        hit_block_ids = match_request(self.blocks, request)
        return waiting_cost(
            len(request.token_ids),
            request.priority,
            hit_block_ids,
            self.blocks,
            self.geometry.max_context_tokens,
            request.deadline_s,
        )

    def _start(self, b: PlanBuilder, request: Request, num_tokens: int, now: float) -> int:
        """Admit `request` as a new sequence feeding up to `num_tokens`. Returns the tokens
        fed; 0 when it no longer fits (a prefix block it counted on was evicted since)."""
        blocks = self.blocks
        block_size = blocks.block_size
        hit_block_ids = match_request(blocks, request)
        num_cached_tokens = len(hit_block_ids) * block_size
        num_to_feed = len(request.token_ids) - num_cached_tokens
        num_tokens = min(num_tokens, num_to_feed)
        if num_tokens < num_to_feed and not self.config.chunked_prefill:
            return 0
        num_new_blocks = -(-num_tokens // block_size)
        if blocks.num_available_blocks - blocks.num_evictable(hit_block_ids) < num_new_blocks:
            return 0
        seq_id = next(self._seq_ids)
        request.admit_order = next(self._admit_orders)
        set_stop_rules(request, self.geometry.eos_token_ids, self.geometry.max_context_tokens)
        b.start(request, seq_id, hit_block_ids, num_new_blocks)
        if request.num_cached_prompt_tokens is None:
            request.num_cached_prompt_tokens = min(num_cached_tokens, request.num_prompt_tokens)
            if self.config.prefix_caching:
                self.num_prefix_query_tokens += request.num_prompt_tokens
                self.num_prefix_hit_tokens += request.num_cached_prompt_tokens
        if request.first_scheduled_s is None:
            request.first_scheduled_s = now
        self.running[seq_id] = request
        self._feed(b, request, num_tokens)
        return num_tokens

    # -- blocks ----------------------------------------------------------------------------

    def _fit_chunk(self, b: PlanBuilder, request: Request, num_tokens: int) -> int:
        """Blocks for the next `num_tokens` of a partial prefill; the chunk shrinks to the
        blocks there are. 0 when the request had to preempt itself or older decoders need
        the blocks."""
        blocks = self.blocks
        block_size = blocks.block_size
        start = request.num_computed_tokens
        # Decoders it would be preempted for, planned after it (decode_first off), keep
        # their blocks as in _admit; when even those are short it is not fed, so it stays
        # their victim.
        num_reserved = self._num_decode_growth_blocks(b, request)
        available = blocks.num_available_blocks - num_reserved
        if available < 0:
            return 0
        num_new_blocks = -(-(start + num_tokens) // block_size) - len(request.block_ids)
        if num_new_blocks > 0:
            if available == 0:
                room = len(request.block_ids) * block_size - start
                if room > 0:
                    return min(num_tokens, room)  # what fits, rather than preempt for more
                if num_reserved:
                    return 0
                if not self._grow(b, request):
                    return 0
                num_new_blocks -= 1
                available = blocks.num_available_blocks
            num_taken = min(num_new_blocks, available)
            if num_taken:
                request.block_ids.extend(blocks.allocate(num_taken))
        return min(num_tokens, len(request.block_ids) * block_size - start)

    def _grow(self, b: PlanBuilder, request: Request) -> bool:
        """Append one block to a running request's table, preempting others while none is
        available. False when the request itself was the victim."""
        blocks, step_id = self.blocks, b.step_id
        # Under the priority policy a lower priority goes first even if fed in this step
        # (as vLLM v1): its entry is taken out of the plan being built.
        may_unfeed = b.may_unfeed if self.by_priority else None
        while blocks.num_available_blocks == 0:
            victim = choose_victim(
                self.running, step_id, self.by_priority, self.tenants, b.only, may_unfeed
            )
            assert victim is not None  # the requester itself is always a candidate
            if victim is not request and victim.last_scheduled_step == step_id:
                self.preempt(victim, worker_knows=b.unfeed(victim))
            else:
                self.preempt(victim)
            if victim is request:
                return False
        request.block_ids.extend(blocks.allocate(1))
        return True

    # -- the plan's columns ----------------------------------------------------------------

    def _feed(self, b: PlanBuilder, request: Request, num_tokens: int) -> None:
        """Feed the request's next `num_tokens` tokens in the plan, charged to its tenant."""
        b.feed(request, num_tokens)
        if self.tenants.fair:
            self.tenants.charge_prompt(request.tenant, num_tokens)
        self.sequences.fed(request)


@dataclass(slots=True)
class _AdmissionRounds:
    """A step's admission rounds so far, across the calls of Planner._admit: whether the
    first is still to run, how many requests they admitted, and whether one admitted
    nothing (which ends admission for the step)."""

    first: bool = True
    num_admitted: int = 0
    ended: bool = False
