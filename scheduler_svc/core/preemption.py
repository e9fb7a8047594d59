"""Who gives up its KV blocks when a running sequence needs one and none is free.

Preemption is by recompute: the victim's blocks are released (its full blocks stay in
the prefix cache, so the recompute is mostly hits), it goes back to the head of the
waiting queue, and its generated tokens are fed again as if they were prompt. Tokens
already streamed are never sampled or streamed again.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagoda.scheduler_svc.core.request import Request


def pick_victim(
    running_newest_first: Iterable[Request], step_id: int, by_priority: bool
) -> Request | None:
    """The running request to preempt, among those not yet fed in step `step_id`.

    The most recently admitted; under the priority policy the lowest priority (highest
    value) first, then the most recently admitted. The requester itself is a candidate,
    so when it is the best victim it preempts itself and nothing deadlocks.
    """
    if not by_priority:
        for request in running_newest_first:
            if request.last_scheduled_step != step_id:
                return request
        return None
    victim: Request | None = None
    for request in running_newest_first:
        if request.last_scheduled_step == step_id:
            continue
        if victim is None or request.priority > victim.priority:
            victim = request  # newest first: ties keep the most recently admitted
    return victim
