"""Preemption by recompute: which running request gives up its blocks (pure policies).

The most recently admitted goes first; under the priority policy the lowest priority
(highest value), then the most recently admitted, even one already fed in the plan being
built when its entry can be taken out again (as vLLM v1). With fair share (tenants.py),
victims come from the most-served tenant first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from pagoda.scheduler_svc.core.request import Request
from pagoda.scheduler_svc.core.tenants import Ledger, victims_order


def choose_victim(
    running: Mapping[int, Request],
    step_id: int,
    by_priority: bool,
    tenants: Ledger,
    only: Mapping[str, Request] | None = None,
    may_unfeed: Callable[[Request], bool] | None = None,
) -> Request | None:
    """The request to preempt among `running` (in admission order) while step `step_id`
    is planned. With `only` (isolation.py), one of those alone; else by tenant group
    while tenants share (`tenants.fair`)."""
    if only is not None:
        candidates = [request for request in running.values() if request.request_id in only]
        return pick_victim(reversed(candidates), step_id, by_priority)
    newest_first = reversed(running.values())
    groups = victims_order(newest_first, tenants.counters()) if tenants.fair else (newest_first,)
    for candidates in groups:
        victim = pick_victim(candidates, step_id, by_priority, may_unfeed)
        if victim is not None:
            return victim
    return None


def pick_victim(
    candidates: Iterable[Request],
    step_id: int,
    by_priority: bool,
    may_unfeed: Callable[[Request], bool] | None = None,
) -> Request | None:
    """The running request to preempt among `candidates` (newest admission first), those
    already fed in step `step_id` excepted unless `may_unfeed` says they can be un-fed.

    The most recently admitted; under the priority policy the lowest priority (highest
    value) first, then the most recently admitted. The requester itself is a candidate,
    so when it is the best victim it preempts itself and nothing deadlocks.
    """
    if not by_priority:
        for request in candidates:
            if request.last_scheduled_step != step_id:
                return request
        return None
    victim: Request | None = None
    for request in candidates:
        if victim is not None and request.priority <= victim.priority:
            continue  # newest first: ties keep the most recently admitted
        if request.last_scheduled_step == step_id and (
            may_unfeed is None or not may_unfeed(request)
        ):
            continue
        victim = request
    return victim
