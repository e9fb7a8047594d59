"""Admission policies: which waiting requests start this step, and with how many tokens.

Pure functions over explicit inputs: no scheduler, no clock. A round first chooses its
window (`admission_window`: which waiting requests it may admit, and under which policy);
`costs` lists them in queue order (any Sequence; the planner passes a lazy view so FIFO
prices only the requests it looks at); an `Admission` names one by its index.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from pagoda.scheduler_svc.core.kv import PrefixCache

T = TypeVar("T")

# Policies that choose among the first `admission_lookahead` waiting requests.
LOOKAHEAD_POLICIES = frozenset({"pack", "prefix", "deadline"})


@dataclass(frozen=True, slots=True)
class WaitingCost:
    """One waiting request as admission sees it."""

    # Tokens to compute before its first sample; cached prefix tokens are free.
    num_tokens: int
    # Evictable cached blocks its prefix hit takes out of the pool when admitted.
    num_reclaimed_blocks: int = 0
    priority: int = 0
    # Prompt tokens its prefix hit serves from the cache (what `prefix` orders by).
    num_cached_tokens: int = 0
    # When its caller stops waiting, on the scheduler's clock (what `deadline` orders by).
    deadline_s: float = math.inf


@dataclass(frozen=True, slots=True)
class AdmissionBudget:
    """What is left of this step for new requests."""

    num_tokens: int  # prefill tokens left
    # Prefill budget of a step with nothing else in it: a request above it never fits
    # whole, so without chunked prefill it is admitted alone rather than stall the queue.
    num_step_tokens: int
    num_requests: int  # admissions left (batch-size cap and active cap)
    num_blocks: int  # KV blocks left (free plus evictable)
    block_size: int
    chunked_prefill: bool
    # Nothing admitted yet this step: an oversize head may go alone, pack may fall back.
    first_round: bool = True


@dataclass(frozen=True, slots=True)
class Admission:
    index: int  # into the costs the policy was given
    num_tokens: int  # tokens computed this step; fewer than the cost for a first chunk


def prefill_cost(num_tokens: int, num_cached_tokens: int, max_context_tokens: int) -> int:
    """Tokens a request still has to compute, clamped to the model's context."""
    return min(num_tokens - num_cached_tokens, max_context_tokens)


def waiting_cost(
    num_tokens: int,
    priority: int,
    hit_block_ids: list[int],
    blocks: PrefixCache,
    max_context_tokens: int,
    deadline_s: float = math.inf,
) -> WaitingCost:
    """A waiting request of `num_tokens` whose prefix hit `hit_block_ids` in `blocks`."""
    num_cached_tokens = len(hit_block_ids) * blocks.block_size
    return WaitingCost(
        num_tokens=prefill_cost(num_tokens, num_cached_tokens, max_context_tokens),
        num_reclaimed_blocks=blocks.num_evictable(hit_block_ids),
        priority=priority,
        num_cached_tokens=num_cached_tokens,
        deadline_s=deadline_s,
    )


def is_fifo_round(round_number: int, force_fifo_every: int | None) -> bool:
    """Whether admission round `round_number` (counted from 1) is forced FIFO."""
    return bool(force_fifo_every) and round_number % force_fifo_every == 0


class WaitingView(Protocol[T]):
    """The waiting queue as a window is read from it (WaitingQueue), in queue order."""

    def head(self, num_requests: int, tenant: str | None = None) -> list[T]: ...

    def oldest(self, num_requests: int, tenant: str | None = None) -> list[T]: ...


def admission_window(
    waiting: WaitingView[T],
    policy: str,
    num_requests: int,
    lookahead: int,
    *,
    forced: bool = False,
    reserved: T | None = None,
    tenant: str | None = None,
    by_priority: bool = False,
    only: list[T] | None = None,
) -> tuple[str, list[T]]:
    """The policy an admission round runs and its window: the waiting requests it may
    admit, in queue order (`num_requests` of them, `lookahead` under pack and prefix).

    `only` (isolation.py): from those waiting requests alone. Else `reserved`, the head a
    forced round could not fit, alone and FIFO: nothing starts past it until it fits. A
    `forced` round (is_fifo_round) is FIFO over the oldest by arrival, not the priority
    head, so low priorities move too. `tenant` (fair share): from that tenant's queue.
    """
    looks_ahead = policy in LOOKAHEAD_POLICIES
    if only is not None:
        return policy, only[: lookahead if looks_ahead else num_requests]
    if reserved is not None:
        return "fifo", [reserved]
    if forced:
        if by_priority:
            return "fifo", waiting.oldest(num_requests, tenant)
        return "fifo", waiting.head(num_requests, tenant)
    return policy, waiting.head(lookahead if looks_ahead else num_requests, tenant)


def room_for_reserved_head(
    cost: WaitingCost, num_step_tokens: int, num_free_blocks: int, block_size: int
) -> int:
    """Tokens the decodes leave for the reserved head (decode_first, unchunked): its cost
    when it fits a step of `num_step_tokens` and `num_free_blocks` alone, else 0.

    Decodes come first, so a head that fits a step but not beside the decodes would
    wait for the running set to drain while the reservation holds every admission
    back (issue 24 item 9). Leaving it room costs a few decoders one step of the
    round-robin instead. An oversize head goes alone anyway and a chunk always fits;
    one that waits for blocks or a free slot is not helped by fewer decodes.
    """
    num_head_blocks = _num_blocks(cost, cost.num_tokens, block_size)
    if cost.num_tokens > num_step_tokens or num_head_blocks > num_free_blocks:
        return 0
    return cost.num_tokens


def admit_fifo(costs: Sequence[WaitingCost], budget: AdmissionBudget) -> list[Admission]:
    """Arrival order while each fits; stop at the first that does not.

    With chunked prefill the first that does not fit gets a chunk of what is left. A
    head larger than any step is admitted alone (whole, or its first chunk).
    """
    return _admit_in_order(costs, range(len(costs)), budget)


def admit_priority(costs: Sequence[WaitingCost], budget: AdmissionBudget) -> list[Admission]:
    """FIFO over (priority, queue position): lower values first, ties keep arrival order."""
    order = sorted(range(len(costs)), key=lambda index: costs[index].priority)
    return _admit_in_order(costs, order, budget)


def admit_prefix(
    costs: Sequence[WaitingCost], budget: AdmissionBudget, lookahead: int
) -> list[Admission]:
    """FIFO over the first `lookahead` requests ordered by their cached prefix, longest
    first (ties keep arrival order): requests whose prefix is in the cache now start
    before it is evicted, and before others' prompts push it out. The first that does
    not fit ends the round (with chunked prefill, it gets a chunk), as in FIFO."""
    window = min(len(costs), lookahead)
    order = sorted(range(window), key=lambda index: -costs[index].num_cached_tokens)
    return _admit_in_order(costs, order, budget)


def admit_deadline(
    costs: Sequence[WaitingCost], budget: AdmissionBudget, lookahead: int
) -> list[Admission]:
    """FIFO over the first `lookahead` requests ordered by their callers' deadlines,
    earliest first (requests without one last; ties keep arrival order): a request whose
    caller gives up soon starts before one that can wait. The first that does not fit ends
    the round (with chunked prefill, it gets a chunk), as in FIFO."""
    window = min(len(costs), lookahead)
    order = sorted(range(window), key=lambda index: costs[index].deadline_s)
    return _admit_in_order(costs, order, budget)


def admit_pack(
    costs: Sequence[WaitingCost], budget: AdmissionBudget, lookahead: int
) -> list[Admission]:
    """Fill the budget from the cheapest of the first `lookahead` requests.

    Admitted requests keep their arrival order; skipped ones keep their places. When
    nothing fits, the head is admitted (its first chunk, or whole if no step could ever
    hold it) so the queue always moves.
    """
    window = min(len(costs), lookahead)
    order = sorted(range(window), key=lambda index: costs[index].num_tokens)
    tokens_left, blocks_left = budget.num_tokens, budget.num_blocks
    admissions: list[Admission] = []
    for index in order:
        if len(admissions) >= budget.num_requests:
            break
        cost = costs[index]
        num_blocks = _num_blocks(cost, cost.num_tokens, budget.block_size)
        if cost.num_tokens <= tokens_left and num_blocks <= blocks_left:
            admissions.append(Admission(index, cost.num_tokens))
            tokens_left -= cost.num_tokens
            blocks_left -= num_blocks
    if admissions:
        admissions.sort(key=lambda admission: admission.index)
        return admissions
    if window == 0 or budget.num_requests < 1 or not budget.first_round:
        return []
    head = _fit(costs[0], 0, tokens_left, blocks_left, budget, may_go_alone=True)
    return [head] if head is not None else []


def _admit_in_order(
    costs: Sequence[WaitingCost], order: Sequence[int] | range, budget: AdmissionBudget
) -> list[Admission]:
    tokens_left, blocks_left = budget.num_tokens, budget.num_blocks
    admissions: list[Admission] = []
    for index in order:
        if len(admissions) >= budget.num_requests:
            break
        cost = costs[index]
        may_go_alone = budget.first_round and not admissions
        admission = _fit(cost, index, tokens_left, blocks_left, budget, may_go_alone)
        if admission is None:
            break
        admissions.append(admission)
        if admission.num_tokens < cost.num_tokens or admission.num_tokens > tokens_left:
            break  # a chunk took what was left, or an oversize head goes alone
        tokens_left -= admission.num_tokens
        blocks_left -= _num_blocks(cost, admission.num_tokens, budget.block_size)
    return admissions


def _fit(
    cost: WaitingCost,
    index: int,
    tokens_left: int,
    blocks_left: int,
    budget: AdmissionBudget,
    may_go_alone: bool,
) -> Admission | None:
    """Admit `cost` whole if it fits, else its first chunk, else (alone) an oversize whole."""
    block_size = budget.block_size
    num_blocks = _num_blocks(cost, cost.num_tokens, block_size)
    if cost.num_tokens <= tokens_left and num_blocks <= blocks_left:
        return Admission(index, cost.num_tokens)
    if budget.chunked_prefill:
        num_tokens = min(tokens_left, (blocks_left - cost.num_reclaimed_blocks) * block_size)
        return Admission(index, num_tokens) if num_tokens >= 1 else None
    if may_go_alone and cost.num_tokens > budget.num_step_tokens and num_blocks <= blocks_left:
        return Admission(index, cost.num_tokens)
    return None


def _num_blocks(cost: WaitingCost, num_tokens: int, block_size: int) -> int:
    """Blocks admitting `num_tokens` of `cost` takes from the pool (its prefix is block-aligned)."""
    return -(-num_tokens // block_size) + cost.num_reclaimed_blocks


def run_policy(
    policy: str, costs: Sequence[WaitingCost], budget: AdmissionBudget, lookahead: int
) -> list[Admission]:
    """The admissions of the named policy ("fifo", "pack", "prefix", "deadline" or
    "priority")."""
    if policy == "pack":
        return admit_pack(costs, budget, lookahead)
    if policy == "prefix":
        return admit_prefix(costs, budget, lookahead)
    if policy == "deadline":
        return admit_deadline(costs, budget, lookahead)
    if policy == "priority":
        return admit_priority(costs, budget)
    return admit_fifo(costs, budget)


class LazyCosts(Sequence[WaitingCost], Generic[T]):
    """Waiting requests priced on first look, so FIFO prices only those it reads."""

    __slots__ = ("_items", "_price", "_costs")

    def __init__(self, items: list[T], price: Callable[[T], WaitingCost]) -> None:
        self._items = items
        self._price = price
        self._costs: list[WaitingCost | None] = [None] * len(items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):  # type: ignore[override]  # ints only
        cost = self._costs[index]
        if cost is None:
            cost = self._costs[index] = self._price(self._items[index])
        return cost
