"""The waiting queue: arrival order, or (priority, arrival) order under the priority policy.

Preempted requests go back to the head (of their priority class): they were admitted
before anything still waiting and hold work already streamed.

Removal is lazy: a removed request's entry is marked dead in O(1) and skipped (then
dropped) when the head is read, so a burst of cancels from a deep queue never scans it.
A second index keeps arrival order alone, so a forced FIFO round under the priority
policy can admit the oldest request rather than the priority head. With `by_tenant`,
each tenant's requests are also kept in a queue of their own (same order), so admission
can look at one tenant's head (core/tenants.py).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator

from pagoda.scheduler_svc.core.request import Request, RequestState

# Dead entries are dropped in one pass once they outnumber this and a quarter of the
# entries: amortised O(1) per removal, and the head never skips more than that.
_MIN_DEAD_TO_COMPACT = 64


class _Entry:
    __slots__ = ("request", "num_tokens")

    def __init__(self, request: Request) -> None:
        self.request: Request | None = request  # None once removed
        self.num_tokens = len(request.token_ids)  # as counted into WaitingQueue.num_tokens


class WaitingQueue:
    __slots__ = (
        "_by_priority",
        "_keys",
        "_entries",
        "_arrivals",
        "_live",
        "_back",
        "_front",
        "_tenants",
        "_tenant_counts",
        "num_tokens",
    )

    def __init__(self, by_priority: bool = False, by_tenant: bool = False) -> None:
        self._by_priority = by_priority
        # tenant name -> its own queue (None: not kept); a tenant's leaves when empty.
        self._tenants: dict[str, WaitingQueue] | None = {} if by_tenant else None
        self._tenant_counts: dict[str, int] = {}  # live requests by tenant, kept always
        # Parallel, sorted by key: (priority or 0, order); head first; dead entries included.
        self._keys: list[tuple[int, int]] = []
        self._entries: list[_Entry] = []
        # The same entries by order alone (arrival order, preempted first).
        self._arrivals: deque[_Entry] = deque()
        self._live: dict[int, _Entry] = {}  # id(request) -> its entry, live ones only
        self._back = itertools.count(1)  # orders for arrivals: increasing
        self._front = itertools.count(-1, -1)  # orders for preempted: before every arrival
        # The tokens (prompt and any streamed before a preemption) of the live requests, as
        # each had when it joined (a waiting request does not grow): placement reads it
        # for every new request, so it is kept rather than summed.
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return (entry.request for entry in self._entries if entry.request is not None)

    def push_back(self, request: Request) -> None:
        entry = self._insert(request, next(self._back))
        self._arrivals.append(entry)
        if self._tenants is not None:
            self._tenant_queue(request.tenant).push_back(request)

    def push_front(self, request: Request) -> None:
        entry = self._insert(request, next(self._front))
        self._arrivals.appendleft(entry)
        if self._tenants is not None:
            self._tenant_queue(request.tenant).push_front(request)

    def tenant_names(self) -> list[str]:
        """The tenants with requests waiting, in order of their first arrival."""
        return list(self._tenants) if self._tenants is not None else []

    def num_waiting_of(self, tenant: str) -> int:
        return self._tenant_counts.get(tenant, 0)

    def head(self, num_requests: int, tenant: str | None = None) -> list[Request]:
        """The first `num_requests` in admission order (of `tenant`'s alone, if named)."""
        if tenant is not None:
            return self._tenants[tenant].head(num_requests)
        entries, keys = self._entries, self._keys
        num_dead = 0
        while num_dead < len(entries) and entries[num_dead].request is None:
            num_dead += 1
        if num_dead:
            del entries[:num_dead], keys[:num_dead]
        arrivals = self._arrivals
        while arrivals and arrivals[0].request is None:
            arrivals.popleft()
        return _first_live(entries, num_requests)

    def oldest(self, num_requests: int, tenant: str | None = None) -> list[Request]:
        """The first `num_requests` by arrival (preempted first), whatever their priority
        (of `tenant`'s alone, if named)."""
        if tenant is not None:
            return self._tenants[tenant].oldest(num_requests)
        arrivals = self._arrivals
        while arrivals and arrivals[0].request is None:
            arrivals.popleft()
        return _first_live(arrivals, num_requests)

    def remove(self, request: Request) -> None:
        entry = self._live.pop(id(request), None)
        if entry is None:
            raise KeyError(request.request_id)
        entry.request = None
        self.num_tokens -= entry.num_tokens
        counts = self._tenant_counts
        counts[request.tenant] -= 1
        if not counts[request.tenant]:
            del counts[request.tenant]
        if self._tenants is not None:
            queue = self._tenants[request.tenant]
            queue.remove(request)
            if not queue:
                del self._tenants[request.tenant]
        # Either index may hold the dead: head() trims the sorted one, oldest() the other.
        num_entries = max(len(self._entries), len(self._arrivals))
        num_dead = num_entries - len(self._live)
        if num_dead > _MIN_DEAD_TO_COMPACT and num_dead * 4 > num_entries:
            self._compact()

    def remove_head_indices(self, indices: list[int]) -> None:
        """Drop the requests at these positions (as `head()` numbered them)."""
        if indices:
            window = self.head(max(indices) + 1)
            for index in indices:
                self.remove(window[index])

    def _tenant_queue(self, tenant: str) -> WaitingQueue:
        queue = self._tenants.get(tenant)
        if queue is None:
            queue = self._tenants[tenant] = WaitingQueue(self._by_priority)
        return queue

    def _compact(self) -> None:
        alive = [i for i, entry in enumerate(self._entries) if entry.request is not None]
        self._keys = [self._keys[i] for i in alive]
        self._entries = [self._entries[i] for i in alive]
        self._arrivals = deque(entry for entry in self._arrivals if entry.request is not None)

    def _insert(self, request: Request, order: int) -> _Entry:
        if id(request) in self._live:
            raise ValueError(f"{request.request_id} is already waiting")
        key = (request.priority if self._by_priority else 0, order)
        entry = _Entry(request)
        if not self._keys or key > self._keys[-1]:
            index = len(self._keys)  # the common case: an arrival joins the tail
        else:
            index = bisect.bisect_left(self._keys, key)
        self._keys.insert(index, key)
        self._entries.insert(index, entry)
        self._live[id(request)] = entry
        self.num_tokens += entry.num_tokens
        self._tenant_counts[request.tenant] = self._tenant_counts.get(request.tenant, 0) + 1
        return entry


def still_waiting(requests: dict[str, Request]) -> list[Request]:
    """The requests of `requests` (request_id -> request) still waiting, in the order given."""
    return [request for request in requests.values() if request.state is RequestState.WAITING]


def _first_live(entries, num_requests: int) -> list[Request]:
    found: list[Request] = []
    if num_requests <= 0:
        return found
    for entry in entries:
        if entry.request is not None:
            found.append(entry.request)
            if len(found) == num_requests:
                break
    return found
