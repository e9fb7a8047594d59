from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagoda.scheduler_svc.core.waiting_queue import WaitingQueue
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import drive, make_geometry, make_request, make_scheduler


def named(name: str, priority: int = 0, num_tokens: int = 0):
    return SimpleNamespace(
        request_id=name, priority=priority, token_ids=[7] * num_tokens, tenant=""
    )


def names(queue: WaitingQueue) -> list[str]:
    return [request.request_id for request in queue]


def test_arrival_order_with_preempted_requests_at_the_head():
    queue = WaitingQueue()
    for name in "abc":
        queue.push_back(named(name))
    # Victims are preempted newest first, so the oldest, pushed last, ends at the head.
    queue.push_front(named("newer"))
    queue.push_front(named("older"))
    assert names(queue) == ["older", "newer", "a", "b", "c"]


def test_priority_order_keeps_arrival_order_among_equals():
    queue = WaitingQueue(by_priority=True)
    for name, priority in [("a", 5), ("b", 1), ("c", 5), ("d", 1)]:
        queue.push_back(named(name, priority))
    queue.push_front(named("p", 5))
    assert names(queue) == ["b", "d", "p", "a", "c"]


def test_removal_by_identity_and_by_head_position():
    queue = WaitingQueue()
    requests = [named(name) for name in "abcd"]
    for request in requests:
        queue.push_back(request)
    queue.remove(requests[1])
    queue.remove_head_indices([0, 2])
    assert names(queue) == ["c"]
    with pytest.raises(KeyError):
        queue.remove(requests[0])


def test_the_queued_token_count_follows_pushes_and_removals_through_compaction():
    """Placement reads num_tokens for every new request (lane_load): it must equal the
    live requests' tokens after any mix of arrivals, preemptions and lazy removals."""
    queue = WaitingQueue(by_priority=True)
    requests = [named(f"r{i}", priority=i % 3, num_tokens=i + 1) for i in range(300)]
    for i, request in enumerate(requests):
        (queue.push_front if i % 7 == 0 else queue.push_back)(request)
    for request in requests[::2]:  # enough dead entries to compact more than once
        queue.remove(request)
    queue.remove_head_indices([0, 3])
    assert queue.num_tokens == sum(len(r.token_ids) for r in queue)
    for request in list(queue):
        queue.remove(request)
    assert queue.num_tokens == 0 and len(queue) == 0


@pytest.mark.parametrize("by_priority", [False, True])
def test_served_requests_leave_no_entry_behind(by_priority):
    """Each request admitted through head() (FIFO and pack rounds, priority rounds that
    are not forced) is removed lazily: neither index may keep its dead entry forever."""
    queue = WaitingQueue(by_priority=by_priority)
    for wave in range(50):
        requests = [named(f"w{wave}-{i}", priority=i % 3) for i in range(40)]
        for request in requests:
            queue.push_back(request)
        while queue:
            queue.remove_head_indices([0])
    assert len(queue) == 0
    assert len(queue._arrivals) <= 4 * 64 and len(queue._entries) <= 4 * 64


def test_the_scheduler_queue_does_not_grow_with_requests_served():
    geometry = make_geometry(num_kv_blocks=256, block_size=4)
    scheduler = make_scheduler(geometry)  # fifo
    worker = FakeWorker(geometry, check=False)
    for wave in range(50):
        for i in range(40):
            scheduler.add(make_request(f"x{wave}-{i}", 6, max_new_tokens=2), 0.0)
        drive(scheduler, worker)
    queue = scheduler.core._planner.waiting
    assert len(queue) == 0 and len(queue._arrivals) <= 4 * 64
