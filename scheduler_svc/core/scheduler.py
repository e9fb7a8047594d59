"""The scheduler core: schedule() returns a StepPlan, apply() turns the worker's StepResult
into token outputs. No I/O and no clock: `now` (seconds, monotonic) is passed in.

At most two plans are in flight, answered in order. schedule() may plan step N+1 while
step N runs when `can_plan_ahead` says so (overlapped steps): a sequence that samples in
N and decodes in N+1 feeds the token N samples, which the worker substitutes
(StepPlan.last_sampled_rows); when N's result ends that sequence, N+1's token for it is
dropped, never streamed. A failed step or a worker loss in N also fails N+1, whose
sequences recompute; a sequence refused in N fails only the rows of N+1 that it taints
(its own, and those that read what it or its readers keyed). Isolation steps run alone,
every other step.
add(), cancel() and stop() may be called at any time.
Text (detokenization, stop strings) is not the core's: the service's output processor
runs right after apply() and ends stop-string hits through stop() before the next
schedule().
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from array import array
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from pagoda.common.step import StepPlan, StepResult, WorkerGeometry
from pagoda.scheduler_svc.core.config import SchedulerConfig
from pagoda.scheduler_svc.core.isolation import Isolation
from pagoda.scheduler_svc.core.kv import ROOT_HASH, cache_root_hash, extend_block_hashes
from pagoda.scheduler_svc.core.outputs import (
    RequestOutput,
    SchedulerStats,
    StepOutputs,
    TokenLogprob,
    timings_of,
    token_logprob,
    usage_of,
)
from pagoda.scheduler_svc.core.placement import LaneLoad
from pagoda.scheduler_svc.core.plan_builder import key_blocks
from pagoda.scheduler_svc.core.planner import Planner
from pagoda.scheduler_svc.core.request import (
    DuplicateRequestError,
    FinishReason,
    QueueFullError,
    Request,
    RequestState,
    RequestTooLargeError,
    ValidRequest,
    check_stop,
    sample_request_ids,
    sample_seed,
    token_array,
    too_large_reason,
)
from pagoda.scheduler_svc.core.speculation import num_kept, record_drafts
from pagoda.scheduler_svc.core.step_budget import StepBudget
from pagoda.scheduler_svc.core.tenants import TenantStats, check_quota

_WAITING = RequestState.WAITING
_RUNNING = RequestState.RUNNING
_HELD = RequestState.HELD
MAX_STEPS_IN_FLIGHT = 2


@dataclass(slots=True)
class _Flight:
    """A plan sent and not yet answered, with what undoing it needs."""

    plan: StepPlan
    keyed: list[tuple[int, int]]  # (seq_id, block_id) keyed for the prefix cache by the plan
    # (request, seq_id, position) decoded ahead whose position completes a block: keyed
    # when the step before answers with the token.
    key_later: list[tuple[Request, int, int]]
    isolated: bool  # a step of the isolation of a failure: nothing runs beside it
    # (writer, reader) seq ids: `reader`, new in this plan or the next, hits a block that
    # `writer` keys in this plan, so it reads K/V this step has yet to write.
    readers: list[tuple[int, int]] = field(default_factory=list)
    # Requests it feeds that planning the next step preempted: suspects if it fails.
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        config.validate()
        self.config = config
        self._requests: dict[str, Request] = {}  # every unfinished request
        # Samples i > 0 of n > 1 requests waiting for their sample 0's prompt blocks, in
        # arrival order (HELD: in _requests, not in the queue; see _release_held).
        self._held: list[Request] = []
        self._planner = Planner(config)
        self._isolation = Isolation(self._requests, self._planner)
        # Sizes each step's prefill from the worker's measured step times (None: off).
        self._step_budget = StepBudget(config.target_step_ms) if config.step_budget_on else None
        if self._step_budget is not None:
            self._planner.cost_model = self._step_budget.model  # it prices drafts too
        self._in_flight: list[_Flight] = []  # oldest first
        self._step_ids = itertools.count(1)
        self._last_now = 0.0  # for outputs of calls that carry no clock (attach_worker)
        self._num_steps = 0
        self._num_isolated_steps = 0
        self._num_requests_finished = 0
        self._num_generated_tokens = 0
        self._num_draft_tokens = 0  # drafted tokens fed (speculation.py)
        self._num_accepted_draft_tokens = 0  # of them, those kept

    # -- worker lifecycle ------------------------------------------------------------------

    @property
    def worker_attached(self) -> bool:
        return self._planner.blocks is not None

    def attach_worker(
        self, geometry: WorkerGeometry, *, overlapped: bool = False
    ) -> list[RequestOutput]:
        """A worker said hello: a fresh pool and prefix cache; running requests recompute.
        `overlapped`: its steps are planned ahead (then speculation is off unless set).

        Returns the finishing outputs of waiting requests this worker can never hold (its
        context or pool is smaller than the last one's) or read (a token id outside its
        vocabulary: the worker would refuse it, see apply()), and those of detach_worker()
        if a worker was attached; usually empty.
        """
        planner = self._planner
        outputs = self.detach_worker("another worker said hello") if self.worker_attached else []
        # Suspects and their solo failures stay: a request that killed the last worker
        # (fail_step) would kill this one too.
        self._isolation.stand_down()
        planner.attach_pool(geometry, overlapped=overlapped)
        if self._step_budget is not None:
            self._step_budget.reset()  # the new worker's costs are learned afresh
        for request in [*planner.waiting, *self._held]:
            reason = too_large_reason(
                request.num_prompt_tokens, request.stopping.max_new_tokens, geometry
            ) or _outside_vocabulary(request, geometry.vocab_size)
            if reason is not None:
                outputs.append(self._finish_with_error(request, reason, self._last_now))
        return outputs

    def detach_worker(
        self, reason: str = "it went away", *, suspect: bool = True
    ) -> list[RequestOutput]:
        """The worker is lost: schedule() returns None until the next attach_worker().

        Steps still in flight were lost with it (the loss may be reported before their
        results fail): they fail here as in fail_step, their requests isolated unless
        `suspect` is False. Returns the output of a request that loss convicts (usually
        none).
        """
        outputs = []
        if self._in_flight:
            outputs = self.fail_step(
                self._in_flight[0].plan, reason, self._last_now, suspect=suspect
            )
        self._in_flight.clear()
        self._planner.drop_pool()
        return outputs

    # -- requests in and out -----------------------------------------------------------------

    def add(self, request: ValidRequest, now: float) -> None:
        """Queue a validated request: its n samples as n requests named by
        sample_request_ids, sample 0 queued and the others held until it has computed the
        prompt's full blocks, which they then share (the prompt is computed once).

        Raises QueueFullError, RequestTooLargeError (checked against the last worker's
        geometry; before any worker, at its attach), DuplicateRequestError.
        """
        self._last_now = now
        planner = self._planner
        request_ids = sample_request_ids(request.request_id, request.n)
        for request_id in request_ids:
            if request_id in self._requests:
                raise DuplicateRequestError(f"request_id {request_id!r} is already in flight")
        if len(planner.waiting) + len(self._held) >= self.config.max_waiting_requests:
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_waiting_requests} requests); "
                "retry later"
            )
        tenants = planner.tenants
        account = tenants.accounts.get(request.tenant)
        if account is not None:
            check_quota(
                request.tenant,
                account.num_requests,
                planner.waiting.num_waiting_of(request.tenant),
                self.config.max_tenant_requests,
                self.config.max_tenant_waiting_requests,
            )
        if not request.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if planner.geometry is not None:
            reason = too_large_reason(
                len(request.prompt_token_ids), request.stopping.max_new_tokens, planner.geometry
            )
            if reason is not None:
                raise RequestTooLargeError(reason)
        shares_prompt = request.n > 1
        root_hash = cache_root_hash(request.cache_salt)
        if shares_prompt and not self.config.prefix_caching:
            # Its samples share blocks with each other only: a root no other request has.
            root_hash = hash((root_hash, "samples", request.request_id, now))
        leader: Request | None = None
        grammar = request.grammar
        for index, request_id in enumerate(request_ids):
            sampling = request.sampling
            if shares_prompt:
                sampling = dataclasses.replace(sampling, seed=sample_seed(sampling.seed, index))
            queued = Request(
                request_id=request_id,
                sampling=sampling,
                stopping=request.stopping,
                priority=request.priority,
                num_prompt_tokens=len(request.prompt_token_ids),
                token_ids=token_array(request.prompt_token_ids),
                arrival_s=now,
                deadline_s=math.inf if request.time_limit_s is None else now + request.time_limit_s,
                cache_root_hash=root_hash,
                tenant=request.tenant,
                grammar=request.sample_grammars[index - 1] if index and grammar else grammar,
                shares_prompt=shares_prompt,
            )
            self._requests[request_id] = queued
            tenants.join(request.tenant, request.tenant_weight)
            if leader is None:
                leader = queued
                planner.waiting.push_back(queued)
            else:
                queued.state = _HELD
                queued.prompt_leader = leader
                self._held.append(queued)

    def cancel(
        self,
        request_id: str,
        now: float,
        reason: FinishReason = FinishReason.CANCELLED,
        message: str | None = None,
    ) -> RequestOutput | None:
        """End a request now; its blocks are free at once and its sequence is forgotten by
        the next plan. None if it is unknown or already finished."""
        self._last_now = now
        request = self._requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, reason, now, message=message)

    def stop(self, request_id: str, now: float, num_dropped: int = 0) -> RequestOutput | None:
        """A stop string matched the request's text: it ends with STOP, as a stop token would,
        less its last `num_dropped` tokens (a speculative step's, after the stop string).
        Called by the step loop right after apply(); None if already finished."""
        request = self._requests.get(request_id)
        if request is not None and num_dropped:
            del request.token_ids[len(request.token_ids) - num_dropped :]
        return self.cancel(request_id, now, FinishReason.STOP)

    def request_of(self, seq_id: int) -> Request | None:
        """The running request of a sequence the last plan named (read only: the step loop
        reads a constrained request's tokens to fill its mask)."""
        return self._planner.running.get(seq_id)

    def has_work(self) -> bool:
        return bool(self._planner.waiting) or bool(self._planner.running) or bool(self._held)

    # -- lanes: one Scheduler per worker (scheduler_svc/front.py) ---------------------------

    def holds(self, request_id: str) -> bool:
        """Whether `request_id` is unfinished here."""
        return request_id in self._requests

    def lane_load(self, token_ids: array[int], root_hash: int = ROOT_HASH) -> LaneLoad:
        """This scheduler's load as a request of `token_ids` (token_array()) under
        `root_hash` (kv.cache_root_hash of its salt) sees it, for placement.choose_lane."""
        planner = self._planner
        blocks = planner.blocks
        if blocks is None:
            return LaneLoad(0, 0, 0, 0, len(planner.running))
        block_size = blocks.block_size
        max_blocks = (len(token_ids) - 1) // block_size  # as the planner's match
        block_hashes: list[int] = []
        if blocks.enabled:
            extend_block_hashes(token_ids, block_hashes, max_blocks, block_size, root_hash)
        num_queued_tokens = planner.waiting.num_tokens
        return LaneLoad(
            num_cached_prefix_blocks=len(blocks.match(block_hashes, max_blocks)),
            num_kv_blocks_used=blocks.allocator.num_used_blocks,
            num_kv_blocks_queued=-(-num_queued_tokens // block_size),
            num_kv_blocks_total=blocks.allocator.num_total_blocks,
            num_running=len(planner.running),
        )

    def hand_over(self) -> tuple[list[Request], list[tuple[str, int]]]:
        """Take every unfinished request out, for another worker's scheduler to `take_over`
        (this worker is lost; detach_worker() put its running ones in the queue): the
        requests in queue order with the tokens they streamed, and the suspects of a
        failure with their solo failures, so a request that kills workers is still
        convicted as it moves."""
        if self.worker_attached:
            raise RuntimeError("hand_over() with a worker attached; detach_worker() first")
        waiting = self._planner.waiting
        requests = list(waiting)
        for request in requests:
            waiting.remove(request)
        for request in self._held:  # queued behind the rest; they share nothing elsewhere
            request.state = _WAITING
            request.prompt_leader = None
        requests += self._held
        self._held = []
        for request in requests:
            del self._requests[request.request_id]
            self._planner.tenants.leave(request.tenant)
        return requests, self._isolation.hand_over()

    def take_over(
        self, requests: list[Request], suspects: list[tuple[str, int]], now: float
    ) -> list[RequestOutput]:
        """Queue the requests another scheduler handed over, at the head (they were
        admitted before anything waiting here, and stream on from the tokens they have);
        returns the finishing outputs of those this worker can never hold or read."""
        self._last_now = now
        planner = self._planner
        outputs = []
        for request in reversed(requests):
            request.block_hashes.clear()  # this worker may use another block size
            request.last_scheduled_step = -1  # step ids are this scheduler's own
            self._requests[request.request_id] = request
            account = planner.tenants.accounts.get(request.tenant)
            planner.tenants.join(request.tenant, account.weight if account else 1.0)
            planner.waiting.push_front(request)
        self._isolation.take_over(suspects)
        geometry = planner.geometry
        for request in requests if geometry is not None else ():
            reason = too_large_reason(
                request.num_prompt_tokens, request.stopping.max_new_tokens, geometry
            ) or _outside_vocabulary(request, geometry.vocab_size)
            if reason is not None:
                outputs.append(self._finish_with_error(request, reason, now))
        return outputs

    # -- one step ----------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def speculative_tokens(self) -> int:
        """Drafts per decoding request with the attached worker (0: none)."""
        return self._planner.speculative_tokens

    @property
    def can_plan_ahead(self) -> bool:
        """Whether the next step may be planned now, before the result of the one in flight:
        exactly one is, no failure is being isolated (its steps run alone), and speculation
        is off (drafts follow a known last token, and the step in flight decides how many
        of its samples a request keeps)."""
        return (
            not self._planner.speculative_tokens
            and len(self._in_flight) == 1
            and not self._in_flight[0].isolated
            and not self._isolation.active
        )

    def schedule(self, now: float, *, ahead: bool = False) -> StepPlan | None:
        """Plan the next step, or None when there is nothing to run or no worker. With
        `ahead`, one step may be in flight (when can_plan_ahead); else none may."""
        self._last_now = now
        planner = self._planner
        if self._held and planner.blocks is not None:
            self._release_held()
        if planner.blocks is None or not (planner.running or planner.waiting):
            return None
        if self._in_flight and not (ahead and self.can_plan_ahead):
            raise RuntimeError(
                f"schedule() while step {self._in_flight[-1].plan.step_id} is in flight; "
                "apply() or fail_step() it first"
            )
        for attempt in range(2):
            step_id = next(self._step_ids)
            isolated = False
            if self._isolation.active:  # group steps and ordinary ones in turn
                built, isolated = self._isolation.plan(step_id, now, self._prefill_cap())
            else:
                built = planner.plan(step_id, now, max_prefill_tokens=self._prefill_cap())
            plan = built.plan
            victims = planner.take_victims()
            if victims and self._in_flight:
                fed = self._in_flight[0].plan.seq_ids
                self._in_flight[0].preempted += [r for seq_id, r in victims if seq_id in fed]
            if plan.seq_ids:
                break
            # Nothing could run. A request that preempted itself for a block (a plan
            # restricted to some requests while a failure is isolated cannot take one
            # from the others) freed its blocks: the next plan runs it, now rather than
            # after an idle turn of the loop. Otherwise the state is as it was: give up.
            if not victims or attempt:
                return None  # (pending forgets wait for the next plan)
        plan.forget_seq_ids = planner.take_forget_seq_ids()
        flight = _Flight(plan, built.keyed, [], isolated)
        if built.ahead:
            self._mark_ahead(flight, built.ahead)
        self._in_flight.append(flight)
        self._record_readers(plan)
        self._num_steps += 1
        self._num_isolated_steps += isolated
        return plan

    def _release_held(self) -> None:
        """Queue the held samples whose sample 0 has computed, or is computing in a step
        not yet answered, every full block of the prompt they may share (the last token
        is always computed, so a prompt's last partial block, under block_size tokens, is
        each sample's own): they hit those blocks in the prefix cache and share them by
        reference count, and a failed step taints them as readers (_record_readers). A
        sample whose sample 0 ended, or moved to another lane, goes as it is. Queued at
        the head, in index order: they arrived before whatever waits."""
        block_size = self._planner.blocks.block_size
        released = []
        for request in self._held:
            leader = request.prompt_leader
            num_shared_tokens = (request.num_prompt_tokens - 1) // block_size * block_size
            if (
                leader.state is _RUNNING
                and leader.num_computed_tokens < num_shared_tokens
                or leader.state is _WAITING
                and self._requests.get(leader.request_id) is leader
            ):
                continue
            released.append(request)
        if not released:
            return
        self._held = [request for request in self._held if request not in released]
        for request in reversed(released):
            request.state = _WAITING
            request.prompt_leader = None
            self._planner.waiting.push_front(request)

    def _prefill_cap(self) -> int | None:
        """The step budget's prompt-token cap for the next plan, from the sequences that
        will decode in it (running, past their prompt; the decode cap applied) and the
        context the step will attend besides its prompt tokens: each decoder's after the
        step (it feeds one token at num_computed_tokens), and the positions already
        computed of the prompts in progress (the planner continues those first).

        Under a decode cap the round-robin picks which decoders go: their contexts are
        taken as the average decoder's (exact when contexts are alike). One pass over the
        running set, no list built: this runs before every plan.
        """
        if self._step_budget is None:
            return None
        planner = self._planner
        running, prefilling = planner.running, planner.prefilling
        num_decode_seqs = len(running) - len(prefilling)
        if num_decode_seqs <= 0:
            return self._step_budget.max_prefill_tokens(0)
        num_decode_context_tokens = num_decode_seqs + sum(
            request.num_computed_tokens for request in running.values()
        )
        num_prefill_context_tokens = 0
        if prefilling:
            num_prefill_context_tokens = sum(
                request.num_computed_tokens for request in prefilling.values()
            )
            num_decode_context_tokens -= num_prefill_context_tokens
        cap = self.config.max_decode_batch_size
        num_rounds = 1
        if cap is not None and num_decode_seqs > cap:
            num_decode_context_tokens = num_decode_context_tokens * cap // num_decode_seqs
            num_rounds = -(-num_decode_seqs // cap)
            num_decode_seqs = cap
        return self._step_budget.max_prefill_tokens(
            num_decode_seqs, num_decode_context_tokens + num_prefill_context_tokens, num_rounds
        )

    @property
    def step_budget(self) -> StepBudget | None:
        """The step budget and its cost model (read only; None when target_step_ms is off)."""
        return self._step_budget

    def _mark_ahead(self, flight: _Flight, ahead: list[tuple[Request, int]]) -> None:
        """The plan's rows that feed the token of the step in flight (those still in it:
        a priority preemption may have taken one out), and the blocks they complete."""
        plan, step_id = flight.plan, flight.plan.step_id
        block_size = self._planner.blocks.block_size
        positions = {
            request.seq_id: (request, position)
            for request, position in ahead
            if request.state is _RUNNING and request.last_scheduled_step == step_id
        }
        plan.last_sampled_rows = [i for i, s in enumerate(plan.seq_ids) if s in positions]
        if self.config.prefix_caching:
            flight.key_later = [
                (request, seq_id, position)
                for seq_id, (request, position) in positions.items()
                if (position + 1) % block_size == 0
            ]

    def _record_readers(self, plan: StepPlan) -> None:
        """Edges from each block keyed by a step not yet answered (this plan or the one in
        flight) to the new sequences of `plan` whose prefix hit reads it: a new sequence
        sends its whole table, its cached blocks first."""
        news = [new for new in plan.new_sequences if new.cached_token_ids]
        if not news:
            return
        writers = {
            block_id: (seq_id, flight)  # the latest key of a block wins
            for flight in self._in_flight
            for seq_id, block_id in flight.keyed
        }
        if not writers:
            return
        block_size = self._planner.blocks.block_size
        row_of = {seq_id: row for row, seq_id in enumerate(plan.seq_ids)}
        for new in news:
            start = plan.block_offsets[row_of[new.seq_id]]
            num_cached_blocks = len(new.cached_token_ids) // block_size
            for block_id in plan.block_ids[start : start + num_cached_blocks]:
                writer = writers.get(block_id)
                if writer is not None:
                    writer[1].readers.append((writer[0], new.seq_id))

    def apply(self, result: StepResult, now: float) -> StepOutputs:
        """Take the worker's sampled tokens: token-id stop rules (check_stop), outputs.
        Finished requests free their blocks now and are forgotten by the next plan."""
        self._last_now = now
        planner = self._planner
        step_outputs = StepOutputs()
        if not self._in_flight or result.step_id != self._in_flight[0].plan.step_id:
            return step_outputs  # a late result of a step already failed or reset
        flight = self._in_flight.pop(0)
        plan, keyed = flight.plan, flight.keyed
        step_ms = result.forward_ms + result.sample_ms
        if self._step_budget is not None and not result.step_error and step_ms > 0:
            self._step_budget.observe(
                plan.num_extra_tokens, plan.num_decode_tokens, step_ms, plan.num_context_tokens
            )
        outputs = step_outputs.outputs
        if result.step_error:
            # The next step feeds sequences the worker forgot: it fails too, requeued first
            # so that this step's requests (admitted earlier) go in front of its own.
            self._fail_flights(0, forgotten=set(plan.seq_ids))
            outputs.extend(self._step_failed(flight, result.step_error, now))
            return step_outputs
        errors = result.errors
        if errors:
            # A refused sequence wrote nothing, so neither did any that read its blocks
            # before they were written: every key they made is dropped, running or not
            # (one cancelled or preempted since keeps none), and the running recompute.
            unwritten = _closure(errors.keys(), flight.readers)
            self._unkey([(seq_id, block_id) for seq_id, block_id in keyed if seq_id in unwritten])
            seq_ids = [s for s in plan.seq_ids if s in unwritten and s not in errors]
            if self._in_flight:  # the step after it is sent: only its tainted rows go
                seq_ids += self._drop_tainted(self._in_flight[0], unwritten, errors.keys())
            planner.requeue(list(dict.fromkeys(seq_ids)), worker_knows=True)
            for seq_id, message in errors.items():
                request = planner.running.get(seq_id)
                if request is not None:
                    outputs.append(
                        self._finish_with_error(request, f"the worker failed it: {message}", now)
                    )
        if plan.draft_counts or result.logprobs:
            self._num_generated_tokens += self._take_runs(plan, result, now, outputs)
        else:
            self._take_tokens(result, now, step_outputs)
            self._num_generated_tokens += len(result.seq_ids)
        # The result's ids are the plan's sampling ones, a drafted row's once per sample
        # (step_codec checks): equal counts mean none is missing. Errors are not counted:
        # one may name a sequence that did not sample.
        if len(result.seq_ids) != plan.num_sampling:
            outputs.extend(self._finish_unsampled(plan, result, now))
        if self._isolation.target is not None:
            self._isolation.cleared()
        if self._in_flight:
            self._key_known(self._in_flight[0])
        return step_outputs

    def _drop_tainted(
        self, flight: _Flight, unwritten: set[int], refused: Iterable[int]
    ) -> list[int]:
        """The step after a refusal, in flight: its rows of the sequences that wrote
        nothing in the step before (`unwritten`), and of those that read what they keyed
        in either step, are garbage. Their keys in it are dropped; returns their seq ids
        to requeue (those `refused` excepted: they end). Its other rows stand, and its
        result is taken as usual (the dropped rows' tokens with it)."""
        tainted = _closure(unwritten, flight.readers)
        if any(seq_id in tainted for seq_id, _ in flight.keyed):
            self._unkey([entry for entry in flight.keyed if entry[0] in tainted])
            flight.keyed = [entry for entry in flight.keyed if entry[0] not in tainted]
        refused = set(refused)
        return [s for s in flight.plan.seq_ids if s in tainted and s not in refused]

    def _unkey(self, keyed: Iterable[tuple[int, int]]) -> None:
        """Drop the prefix keys of blocks whose K/V a failed step never wrote."""
        blocks = self._planner.blocks
        assert blocks is not None
        for _, block_id in keyed:
            blocks.unregister(block_id)

    def _key_known(self, flight: _Flight) -> None:
        """The tokens of the step just applied are known: key the blocks `flight`'s ahead
        decodes complete (dropped with flight.keyed if it fails). A request that ended or
        was preempted meanwhile keys nothing: its row's token is dropped."""
        planner = self._planner
        for request, seq_id, position in flight.key_later:
            if request.seq_id == seq_id and len(request.token_ids) > position:
                # Its token is now known: key the block it completes.
                key_blocks(planner.blocks, request, position, position + 1, flight.keyed)
        flight.key_later = []

    def _step_failed(self, flight: _Flight, error: str, now: float) -> list[RequestOutput]:
        """The worker forgot every sequence the plan named: all are recomputed, the requests
        of a failed group first in halves (isolation.py); one that keeps failing alone is
        the culprit and ends with ERROR, so a poison request harms no other."""
        planner = self._planner
        self._unkey(flight.keyed)
        request_ids = self._suspects([flight])
        planner.requeue(flight.plan.seq_ids, worker_knows=False)
        return self._isolate(request_ids, f"the worker failed on this request: {error}", now)

    def _suspects(self, flights: list[_Flight]) -> list[str]:
        """The unfinished requests the flights' plans fed: those running, and those
        preempted while the next step was planned (back in the queue)."""
        running, requests = self._planner.running, self._requests
        request_ids = []
        for flight in flights:
            request_ids += [running[s].request_id for s in flight.plan.seq_ids if s in running]
            request_ids += [
                r.request_id for r in flight.preempted if requests.get(r.request_id) is r
            ]
        return list(dict.fromkeys(request_ids))

    def _isolate(self, request_ids: list[str], message: str, now: float) -> list[RequestOutput]:
        """The requests of a failed or lost step (requeued) become suspects; one that
        failed alone again is the culprit and ends with ERROR and `message`."""
        convicted = self._isolation.failed(request_ids)
        if convicted is None:
            return []
        return [self._finish_with_error(self._requests[convicted], message, now)]

    def _take_tokens(self, result: StepResult, now: float, step_outputs: StepOutputs) -> None:
        """The hot loop of apply(): one sampled token per running request, no logprobs."""
        running = self._planner.running
        request_ids, token_ids = step_outputs.request_ids, step_outputs.token_ids
        outputs = step_outputs.outputs
        for seq_id, token_id in zip(result.seq_ids, result.token_ids, strict=True):
            # An exception rather than a test for the rare case: a try costs nothing in 3.11.
            try:
                request = running[seq_id]
            except KeyError:
                continue  # cancelled while the step ran
            request.token_ids.append(token_id)
            if request.first_token_s is None:
                request.first_token_s = now
            finish_reason = check_stop(request, token_id)
            if finish_reason is None:
                request_ids.append(request.request_id)
                token_ids.append(token_id)
            else:
                outputs.append(self._finish(request, finish_reason, now, [token_id]))

    def _take_runs(
        self, plan: StepPlan, result: StepResult, now: float, outputs: list[RequestOutput]
    ) -> int:
        """apply() for a plan with drafts (speculation.py) or a result with logprobs: each
        sequence's samples come in a run, one per draft and one after them (one alone for
        a row without drafts); it keeps them while each equals its draft, then one more,
        each through the stop rules as if decoded alone, and gets them in one output with
        their logprobs. The accepted drafts' K/V is written: they count as computed, and
        the blocks they complete are keyed. Tokens taken."""
        running, planner = self._planner.running, self._planner
        drafts_of = {
            plan.seq_ids[i]: plan.drafts(i) for i, count in enumerate(plan.draft_counts) if count
        }
        seq_ids, token_ids = result.seq_ids, result.token_ids
        num_taken, index = 0, 0
        while index < len(seq_ids):
            seq_id = seq_ids[index]
            drafts = drafts_of.get(seq_id, ())
            first, index = index, index + len(drafts) + 1
            request = running.get(seq_id)
            if request is None:
                continue  # cancelled while the step ran
            kept = num_kept(drafts, token_ids[first:index])
            if drafts:
                self._num_draft_tokens += len(drafts)
                self._num_accepted_draft_tokens += kept - 1
                if request.forced_drafts_step != plan.step_id:
                    record_drafts(request, len(drafts), kept - 1)
            wants_logprobs = bool(request.sampling.num_logprobs and result.logprobs)
            taken: list[int] = []
            finish_reason = None
            for sample in range(first, first + kept):
                token_id = token_ids[sample]
                request.token_ids.append(token_id)
                taken.append(token_id)
                finish_reason = check_stop(request, token_id)
                if finish_reason is not None:
                    break
            num_taken += len(taken)
            if request.first_token_s is None:
                request.first_token_s = now
            logprobs = (
                [token_logprob(result, sample) for sample in range(first, first + len(taken))]
                if wants_logprobs
                else None
            )
            if finish_reason is not None:
                outputs.append(self._finish(request, finish_reason, now, taken, logprobs))
                continue
            if len(taken) > 1:
                # Its accepted drafts were fed at the positions the kept samples now hold.
                start = request.num_computed_tokens
                request.num_computed_tokens = start + len(taken) - 1
                if self.config.prefix_caching or request.shares_prompt:
                    key_blocks(planner.blocks, request, start, request.num_computed_tokens, [])
            outputs.append(RequestOutput(request.request_id, "", taken, logprobs))
        return num_taken

    def fail_step(
        self, plan: StepPlan, error: str, now: float, *, suspect: bool = True
    ) -> list[RequestOutput]:
        """The worker was lost or timed out during `plan`: its sequences, and those of the
        step after it if one is in flight, go back to the waiting queue for recompute;
        nothing streamed is lost or repeated. A worker that dies on a request is isolated
        as a failed step is: the requests become suspects, and one whose step alone lost
        the worker twice ends with ERROR. With `suspect` False (the worker broke the
        protocol, or the plan was never sent) the requests are only requeued."""
        self._last_now = now
        step_ids = [flight.plan.step_id for flight in self._in_flight]
        if plan.step_id not in step_ids:
            return []
        start = step_ids.index(plan.step_id)
        request_ids = self._suspects(self._in_flight[start:])
        self._fail_flights(start)
        if not suspect:
            return []
        return self._isolate(request_ids, f"the worker was lost on this request: {error}", now)

    def _fail_flights(self, start: int, forgotten: Collection[int] = ()) -> None:
        """Steps in flight from `start` on count as never run: their keys dropped, their
        sequences requeued (the earliest step's at the head), but those `forgotten` by
        the worker (the caller requeues them). A late result of one is ignored (apply()
        no longer knows its step)."""
        planner = self._planner
        failed = self._in_flight[start:]
        del self._in_flight[start:]
        for flight in reversed(failed):
            self._unkey(flight.keyed)
            # The plan may never have arrived: send its forgets again (a worker ignores
            # forgets of sequences it does not hold).
            planner.forget_seq_ids.extend(flight.plan.forget_seq_ids)
            planner.requeue(
                [seq_id for seq_id in flight.plan.seq_ids if seq_id not in forgotten],
                worker_knows=True,
            )

    @property
    def stats(self) -> SchedulerStats:
        planner = self._planner
        blocks = planner.blocks
        queried = planner.num_prefix_query_tokens
        return SchedulerStats(
            num_waiting=len(planner.waiting) + len(self._held),
            num_running=len(planner.running),
            num_kv_blocks_used=blocks.allocator.num_used_blocks if blocks else 0,
            num_kv_blocks_total=blocks.allocator.num_total_blocks if blocks else 0,
            num_kv_blocks_cached=blocks.num_cached_free_blocks if blocks else 0,
            prefix_cache_hit_rate=planner.num_prefix_hit_tokens / queried if queried else 0.0,
            num_preemptions=planner.num_preemptions,
            num_steps=self._num_steps,
            num_isolated_steps=self._num_isolated_steps,
            num_requests_finished=self._num_requests_finished,
            num_generated_tokens=self._num_generated_tokens,
            num_draft_tokens=self._num_draft_tokens,
            num_accepted_draft_tokens=self._num_accepted_draft_tokens,
            num_prefix_queries_tokens=queried,
            num_prefix_hit_tokens=planner.num_prefix_hit_tokens,
            **self._step_budget_stats(),
        )

    def tenant_stats(self) -> list[TenantStats]:
        """Each tenant seen by this scheduler, by name."""
        planner = self._planner
        stats = []
        for name, account in sorted(planner.tenants.accounts.items()):
            num_waiting = planner.waiting.num_waiting_of(name)
            stats.append(
                TenantStats(
                    tenant=name,
                    num_waiting=num_waiting,
                    num_running=account.num_requests - num_waiting,
                    num_served_tokens=account.num_served_tokens,
                    num_preemptions=account.num_preemptions,
                    num_requests_finished=account.num_requests_finished,
                )
            )
        return stats

    def _step_budget_stats(self) -> dict[str, float]:
        config, budget = self.config, self._step_budget
        cap = min(config.max_num_batched_tokens, config.prefill_max_tokens or math.inf)
        if budget is None:
            return {"step_prefill_cap_tokens": int(cap)}
        model = budget.model
        if budget.last_cap_tokens is not None:
            cap = min(cap, budget.last_cap_tokens)
        return {
            "step_prefill_cap_tokens": int(cap),
            "step_cost_intercept_ms": model.intercept_ms,
            "step_cost_prefill_ms_per_token": model.prefill_ms_per_token,
            "step_cost_decode_ms_per_seq": model.decode_ms_per_seq,
            "step_cost_context_ms_per_token": model.context_ms_per_token,
        }

    # -- finishing ----------------------------------------------------------------------------

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        now: float,
        token_ids: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
        message: str | None = None,
    ) -> RequestOutput:
        """The one finish path: blocks released, the request forgotten, the last output."""
        if request.state is _HELD:
            self._held.remove(request)
            request.prompt_leader = None
        self._planner.finish(request)
        request.finish_s = now
        del self._requests[request.request_id]
        self._num_requests_finished += 1
        tenants = self._planner.tenants
        account = tenants.accounts[request.tenant]
        account.num_served_tokens += len(request.token_ids)
        account.num_requests_finished += 1
        tenants.leave(request.tenant)
        return RequestOutput(
            request_id=request.request_id,
            text="",
            token_ids=token_ids if token_ids is not None else [],
            logprobs=logprobs,
            finish_reason=reason,
            error_message=message,
            usage=usage_of(request),
            timings=timings_of(request),
        )

    def _finish_with_error(self, request: Request, message: str, now: float) -> RequestOutput:
        return self._finish(request, FinishReason.ERROR, now, message=message)

    def _finish_unsampled(
        self, plan: StepPlan, result: StepResult, now: float
    ) -> list[RequestOutput]:
        """Sequences that should have sampled but got neither a token nor an error."""
        answered = set(result.seq_ids) | set(result.errors)
        outputs = []
        for seq_id, sampled in zip(plan.seq_ids, plan.sample, strict=True):
            request = self._planner.running.get(seq_id)
            if sampled and seq_id not in answered and request is not None:
                outputs.append(
                    self._finish_with_error(request, "the worker returned no token for it", now)
                )
        return outputs


def _closure(seq_ids: Iterable[int], edges: list[tuple[int, int]]) -> set[int]:
    """`seq_ids` and every sequence reachable from them along (from, to) `edges`."""
    reached = set(seq_ids)
    grew = bool(edges)
    while grew:  # a reader comes after its writer: one pass, usually
        grew = False
        for source, target in edges:
            if source in reached and target not in reached:
                reached.add(target)
                grew = True
    return reached


def _outside_vocabulary(request: Request, vocab_size: int) -> str | None:
    """Why a queued request holds a token id a worker of `vocab_size` refuses, or None."""
    largest = max(request.token_ids)
    if largest < vocab_size:
        return None
    return f"token id {largest} is outside the vocabulary of {vocab_size} of the worker attached"
