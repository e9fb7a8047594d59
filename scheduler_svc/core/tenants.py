"""Fair share between tenants: each tenant's weighted service, counted in tokens.

The Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language Models"
(OSDI 2024): a tenant's counter grows by (prompt tokens computed * prompt_weight +
generated tokens * generated_weight) / its weight. Admission serves the waiting tenant
with the lowest counter first; preemption takes its victims from the most-served tenant
first; partial prefills continue least-served first, those of tenants served as much as
the neediest waiting one or more after its next admission. A tenant that arrives (or
returns from idle) is lifted to the least-served active tenant's counter, so it cannot
bank credit while idle. Within a tenant the admission policy and priority apply as before.

Admission alone waits for a free slot, one flood request's length under a flood that
holds every slot (issue 27). So before each plan, the least-served waiting tenant may
preempt to admit (`admission_victims`): when it is below its share of what it lacks (the
active slots, or the KV blocks), it takes the room of requests of other tenants that are
served as much or more and above their share, most-served first, newest admission first, at most
MAX_ADMISSION_VICTIMS a step and none admitted in the last MIN_VICTIM_AGE_STEPS steps (a
victim readmitted is not preempted again at once). It never takes from its own tenant or
a less-served one, and never brings a tenant below its share: once every tenant holds its
share, nothing more is preempted, so two backlogged tenants do not take turns preempting.

The planner consults the ledger only while two tenants or more have unfinished requests
(`fair`): with one tenant, plans are exactly those without tenants. Recompute after a
preemption counts as prompt tokens computed again (it is worker time spent on the tenant).
The policies are the pure functions at the end; the Ledger is their state.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from pagoda.scheduler_svc.core.config import DEFAULT_GENERATED_WEIGHT, DEFAULT_PROMPT_WEIGHT
from pagoda.scheduler_svc.core.request import QueueFullError

# Preempt-to-admit's bounds (see the module docstring).
MAX_ADMISSION_VICTIMS = 4
MIN_VICTIM_AGE_STEPS = 8


class TenantQuotaError(QueueFullError):
    """A tenant is at one of its caps (RESOURCE_EXHAUSTED); the message names the cap."""


@dataclass(frozen=True, slots=True)
class TenantStats:
    """One tenant's figures (a name, never a key)."""

    tenant: str
    num_waiting: int
    num_running: int
    num_served_tokens: int  # prompt and generated tokens of its finished requests
    num_preemptions: int
    num_requests_finished: int


@dataclass(slots=True)
class TenantAccount:
    """One tenant as the scheduler sees it. Counts are of this scheduler (one lane)."""

    name: str
    weight: float = 1.0
    counter: float = 0.0  # weighted tokens served (VTC), lifted on return
    num_requests: int = 0  # unfinished: waiting or running
    # Of its finished requests: prompt and generated tokens (as their usage says).
    num_served_tokens: int = 0
    num_preemptions: int = 0
    num_requests_finished: int = 0


class Ledger:
    """The accounts of every tenant seen, and which are active (have unfinished requests).

    Called only from the scheduler core (add, finish, planning)."""

    __slots__ = ("accounts", "num_active", "prompt_weight", "generated_weight", "enabled")

    def __init__(
        self,
        *,
        enabled: bool = True,
        prompt_weight: float = DEFAULT_PROMPT_WEIGHT,
        generated_weight: float = DEFAULT_GENERATED_WEIGHT,
    ) -> None:
        self.accounts: dict[str, TenantAccount] = {}
        self.num_active = 0
        self.prompt_weight = prompt_weight
        self.generated_weight = generated_weight
        self.enabled = enabled

    @property
    def fair(self) -> bool:
        """Whether the planner shares by tenant now: on, and two tenants or more active."""
        return self.enabled and self.num_active > 1

    def account(self, name: str) -> TenantAccount:
        account = self.accounts.get(name)
        if account is None:
            account = self.accounts[name] = TenantAccount(name)
        return account

    def join(self, name: str, weight: float) -> TenantAccount:
        """A request of `name` is unfinished here (arrived or taken over)."""
        account = self.account(name)
        account.weight = weight
        if account.num_requests == 0:
            active = [a.counter for a in self.accounts.values() if a.num_requests > 0]
            account.counter = lifted_counter(account.counter, active)
            self.num_active += 1
        account.num_requests += 1
        return account

    def leave(self, name: str) -> None:
        """A request of `name` finished or moved away."""
        account = self.accounts[name]
        account.num_requests -= 1
        if account.num_requests == 0:
            self.num_active -= 1
            if self.num_active == 0:
                # Nobody is served: nobody owes or is owed anything any more.
                for each in self.accounts.values():
                    each.counter = 0.0

    def charge_prompt(self, name: str, num_tokens: int) -> None:
        account = self.accounts[name]
        account.counter += num_tokens * self.prompt_weight / account.weight

    def charge_generated(self, names: Iterable[str]) -> None:
        """One generated token for each name (a decode each)."""
        counts: dict[str, int] = {}
        for name in names:
            counts[name] = counts.get(name, 0) + 1
        for name, count in counts.items():
            account = self.accounts[name]
            account.counter += count * self.generated_weight / account.weight

    def neediest(self, waiting: list[str]) -> str | None:
        """The waiting tenant (of `waiting`, as WaitingQueue.tenant_names) admission serves
        next, or None (not sharing by tenant)."""
        if not self.fair:
            return None
        if len(waiting) < 2:
            return None  # the one tenant waiting: the whole window is its own
        return neediest_tenant(waiting, self.counters(), self.num_requests())

    def counters(self) -> dict[str, float]:
        return {name: account.counter for name, account in self.accounts.items()}

    def num_requests(self) -> dict[str, int]:
        """Each tenant's unfinished requests (waiting or running)."""
        return {name: account.num_requests for name, account in self.accounts.items()}


def check_quota(
    name: str,
    num_requests: int,
    num_waiting: int,
    max_requests: int | None,
    max_waiting: int | None,
) -> None:
    """Raise TenantQuotaError when one more request of tenant `name` would pass a cap."""
    if max_requests is not None and num_requests >= max_requests:
        raise TenantQuotaError(
            f"tenant {name} has {num_requests} requests in flight, its limit "
            f"(max_tenant_requests); retry later"
        )
    if max_waiting is not None and num_waiting >= max_waiting:
        raise TenantQuotaError(
            f"tenant {name} has {num_waiting} requests queued, its limit "
            f"(max_tenant_waiting_requests); retry later"
        )


# -- the policies --------------------------------------------------------------------------


def lifted_counter(counter: float, active_counters: Iterable[float]) -> float:
    """A new or returning tenant's counter: at least the least-served active tenant's."""
    return max(counter, min(active_counters, default=counter))


def neediest_tenant(
    waiting: Iterable[str],
    counters: Mapping[str, float],
    num_requests: Mapping[str, int] | None = None,
) -> str | None:
    """The waiting tenant to admit from: the lowest counter; ties: the fewest unfinished
    requests (when given: a tenant just lifted to a flood's counter goes first), then the
    first given."""
    best, best_key = None, (0.0, 0)
    for name in waiting:
        key = neediness(name, counters, num_requests)
        if best is None or key < best_key:
            best, best_key = name, key
    return best


def neediness(
    name: str, counters: Mapping[str, float], num_requests: Mapping[str, int] | None = None
) -> tuple[float, int]:
    """The order neediest_tenant takes: a lower key is needier (its counter, then its
    unfinished requests when given)."""
    return counters[name], num_requests[name] if num_requests is not None else 0


def by_least_served(requests: list, counters: Mapping[str, float]) -> list:
    """`requests` (each with a `tenant`) least-served tenant first; a stable order within."""
    return sorted(requests, key=lambda request: counters[request.tenant])


def victims_order(newest_first: Iterable, counters: Mapping[str, float]) -> list[list]:
    """Candidate victims grouped by tenant, most-served tenant first; each group keeps the
    newest-first order it was given."""
    groups: dict[str, list] = {}
    for request in newest_first:
        groups.setdefault(request.tenant, []).append(request)
    ranked = sorted(groups, key=lambda name: -counters[name])
    return [groups[name] for name in ranked]


@dataclass(slots=True)
class Shortage:
    """What the waiting tenant `needy` lacks to start its head request, and what each
    active tenant holds of it: running requests (of `num_slots`: max_active_requests) and
    KV blocks (of `num_blocks`: the pool)."""

    needy: str
    num_slots_short: int
    num_blocks_short: int
    num_slots: int
    num_blocks: int
    weights: dict[str, float]  # the active tenants'
    num_running: dict[str, int] = field(default_factory=dict)
    num_held_blocks: dict[str, int] = field(default_factory=dict)

    def share(self, name: str, total: int) -> float:
        """`name`'s weighted share of `total` among the active tenants."""
        return total * self.weights.get(name, 1.0) / sum(self.weights.values())


def admission_shortage(
    needy: str,
    num_head_tokens: int,
    num_head_reclaimed_blocks: int,
    running: Collection,
    num_available_blocks: int,
    block_size: int,
    num_slots: int,
    num_blocks: int,
    accounts: Mapping[str, TenantAccount],
) -> Shortage | None:
    """What `needy` lacks to start its head request (`num_head_tokens` to compute, and
    the cached blocks its prefix hit takes out of the pool) beside `running` (each as
    `holdings` reads it), with `num_available_blocks` of the pool's `num_blocks`, and at
    most `num_slots` running; None when there is a slot, and blocks even if every running
    request grows (found without a pass over `running`)."""
    num_head_blocks = -(-num_head_tokens // block_size) + num_head_reclaimed_blocks
    num_slots_short = len(running) + 1 - num_slots
    num_blocks_short = num_head_blocks - num_available_blocks
    if num_slots_short <= 0 and num_blocks_short + len(running) <= 0:
        return None  # a slot, and blocks even if every running request grows
    num_running, num_held, num_demand = holdings(running, block_size)
    return Shortage(
        needy=needy,
        num_slots_short=num_slots_short,
        num_blocks_short=num_blocks_short + num_demand,
        num_slots=num_slots,
        num_blocks=num_blocks,
        weights={name: a.weight for name, a in accounts.items() if a.num_requests},
        num_running=num_running,
        num_held_blocks=num_held,
    )


def admission_victims(
    shortage: Shortage,
    newest_first: Iterable,
    counters: Mapping[str, float],
    step_id: int,
    max_victims: int = MAX_ADMISSION_VICTIMS,
    min_age_steps: int = MIN_VICTIM_AGE_STEPS,
) -> list:
    """The running requests (each with `tenant`, `admit_step` and `block_ids`, given newest
    admission first) to preempt before step `step_id` so that `shortage.needy` can start:
    none unless it is below its share of each thing it lacks; then requests of other
    tenants served as much as it or more (a counter as high: a tenant that just joined is
    lifted to the flood's) and above their share of what is short, most served first,
    newest first within, admitted `min_age_steps` or more steps ago, until
    what is short is covered (a victim's blocks counted as freed) or `max_victims`."""
    s = shortage
    slots_short, blocks_short = s.num_slots_short, s.num_blocks_short
    needy = s.needy
    if slots_short <= 0 and blocks_short <= 0:
        return []
    if slots_short > 0 and s.num_running.get(needy, 0) >= s.share(needy, s.num_slots):
        return []
    if blocks_short > 0 and s.num_held_blocks.get(needy, 0) >= s.share(needy, s.num_blocks):
        return []
    floor = counters[needy]
    running, held = dict(s.num_running), dict(s.num_held_blocks)
    victims: list = []
    for group in victims_order(newest_first, counters):
        name = group[0].tenant
        if counters[name] < floor:
            break  # the rest are served less than the needy tenant
        if name == needy:
            continue
        slot_share, block_share = s.share(name, s.num_slots), s.share(name, s.num_blocks)
        for request in group:
            if step_id - request.admit_step < min_age_steps:
                continue
            over_slots = slots_short > 0 and running[name] - 1 >= slot_share
            over_blocks = blocks_short > 0 and held[name] - len(request.block_ids) >= block_share
            if not (over_slots or over_blocks):
                continue  # taking it would bring its tenant below its share
            victims.append(request)
            running[name] -= 1
            held[name] -= len(request.block_ids)
            slots_short -= 1
            blocks_short -= len(request.block_ids)
            if (slots_short <= 0 and blocks_short <= 0) or len(victims) == max_victims:
                return victims
    return victims


def holdings(running: Iterable, block_size: int) -> tuple[dict[str, int], dict[str, int], int]:
    """Of `running` (each with `tenant`, `token_ids`, `num_computed_tokens`, `block_ids`):
    each tenant's running requests and KV blocks held, and the blocks they will take next
    step before any admission (a decoder at a block boundary, the rest of a prompt)."""
    num_running: dict[str, int] = {}
    num_held: dict[str, int] = {}
    num_demand_blocks = 0
    for request in running:
        name, num_blocks = request.tenant, len(request.block_ids)
        num_running[name] = num_running.get(name, 0) + 1
        num_held[name] = num_held.get(name, 0) + num_blocks
        num_next = max(len(request.token_ids), request.num_computed_tokens + 1)
        num_demand_blocks += max(0, -(-num_next // block_size) - num_blocks)
    return num_running, num_held, num_demand_blocks
