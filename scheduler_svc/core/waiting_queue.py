"""The waiting queue: arrival order, or (priority, arrival) order under the priority policy.

Preempted requests go back to the head (of their priority class): they were admitted
before anything still waiting and hold work already streamed.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

from pagoda.scheduler_svc.core.request import Request


class WaitingQueue:
    __slots__ = ("_by_priority", "_keys", "_requests", "_back", "_front")

    def __init__(self, by_priority: bool = False) -> None:
        self._by_priority = by_priority
        # Parallel, sorted by key: (priority or 0, order); head first.
        self._keys: list[tuple[int, int]] = []
        self._requests: list[Request] = []
        self._back = itertools.count(1)  # orders for arrivals: increasing
        self._front = itertools.count(-1, -1)  # orders for preempted: before every arrival

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def push_back(self, request: Request) -> None:
        self._insert(request, next(self._back))

    def push_front(self, request: Request) -> None:
        self._insert(request, next(self._front))

    def head(self, num_requests: int) -> list[Request]:
        """The first `num_requests` in admission order."""
        return self._requests[:num_requests]

    def remove(self, request: Request) -> None:
        for index, waiting in enumerate(self._requests):
            if waiting is request:
                del self._keys[index], self._requests[index]
                return
        raise KeyError(request.request_id)

    def remove_head_indices(self, indices: list[int]) -> None:
        """Drop the requests at these positions (as `head()` numbered them)."""
        for index in sorted(indices, reverse=True):
            del self._keys[index], self._requests[index]

    def _insert(self, request: Request, order: int) -> None:
        key = (request.priority if self._by_priority else 0, order)
        if not self._keys or key > self._keys[-1]:
            index = len(self._keys)  # the common case: an arrival joins the tail
        else:
            index = bisect.bisect_left(self._keys, key)
        self._keys.insert(index, key)
        self._requests.insert(index, request)
