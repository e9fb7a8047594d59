"""Fair share between tenants: each tenant's weighted service, counted in tokens.

The Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language Models"
(OSDI 2024): a tenant's counter grows by (prompt tokens computed * prompt_weight +
generated tokens * generated_weight) / its weight. Admission serves the waiting tenant
with the lowest counter first; preemption takes its victims from the most-served tenant
first; partial prefills continue least-served first. A tenant that arrives (or returns
from idle) is lifted to the least-served active tenant's counter, so it cannot bank
credit while idle. Within a tenant the admission policy and priority apply as before.

The planner consults the ledger only while two tenants or more have unfinished requests
(`fair`): with one tenant, plans are exactly those without tenants. Recompute after a
preemption counts as prompt tokens computed again (it is worker time spent on the tenant).
The policies are the pure functions at the end; the Ledger is their state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pagoda.scheduler_svc.core.config import DEFAULT_GENERATED_WEIGHT, DEFAULT_PROMPT_WEIGHT
from pagoda.scheduler_svc.core.request import QueueFullError


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

    def counters(self) -> dict[str, float]:
        return {name: account.counter for name, account in self.accounts.items()}


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


def neediest_tenant(waiting: Iterable[str], counters: Mapping[str, float]) -> str | None:
    """The waiting tenant to admit from: the lowest counter (ties: the first given)."""
    best, best_counter = None, 0.0
    for name in waiting:
        counter = counters[name]
        if best is None or counter < best_counter:
            best, best_counter = name, counter
    return best


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
