"""Issue 14 items 3 and 7: forced FIFO rounds under priority and pack, the head
reservation, O(1) removal from a deep waiting queue and the bounded, skippable lookahead."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from pagoda.scheduler_svc.core import waiting_queue
from pagoda.scheduler_svc.core.config import ConfigError, SchedulerConfig
from pagoda.scheduler_svc.core.request import RequestState
from pagoda.scheduler_svc.core.waiting_queue import WaitingQueue
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import check_invariants, make_geometry, make_request, make_scheduler


def _lines_run_by_remove(queue: WaitingQueue, request: object) -> int:
    """Line events inside waiting_queue.py while `request` is removed: a scan shows up as
    lines per element, whatever the clock says."""
    counted = [0]
    path = waiting_queue.__file__

    def trace(frame, event, arg):
        if frame.f_code.co_filename != path:
            return None
        if event == "line":
            counted[0] += 1
        return trace

    sys.settrace(trace)
    try:
        queue.remove(request)
    finally:
        sys.settrace(None)
    return counted[0]


@pytest.mark.parametrize("by_priority", [False, True])
def test_removal_from_a_deep_queue_does_not_scan_it(by_priority):
    lines = []
    for depth in (10, 10_000):
        queue = WaitingQueue(by_priority=by_priority)
        requests = [
            SimpleNamespace(request_id=str(i), priority=i % 3, token_ids=[1], tenant="")
            for i in range(depth)
        ]
        for request in requests:
            queue.push_back(request)
        lines.append(_lines_run_by_remove(queue, requests[-2]))
        assert len(queue) == depth - 1 and requests[-2] not in list(queue)
    assert lines[1] == lines[0] < 50


def test_admission_lookahead_is_capped():
    with pytest.raises(ConfigError, match="admission_lookahead must be <= 256, got 257"):
        SchedulerConfig(admission_lookahead=257).validate()
    SchedulerConfig(admission_lookahead=256).validate()


def test_a_full_pool_prices_no_waiting_request():
    geometry = make_geometry(num_kv_blocks=8, block_size=4)
    scheduler = make_scheduler(geometry, admission_policy="pack", admission_lookahead=256)
    worker = FakeWorker(geometry)
    scheduler.add(make_request("big", 30, max_new_tokens=3), 0.0)
    scheduler.apply(worker.step(scheduler.schedule(0.0)), 0.0)  # 8 blocks: the whole pool
    for index in range(300):
        scheduler.add(make_request(f"w{index}", 4), 0.0)
    planner = scheduler.core._planner
    assert planner.blocks.num_available_blocks == 0
    priced = []
    price = planner._price
    planner._price = lambda request: priced.append(request) or price(request)
    scheduler.apply(worker.step(scheduler.schedule(0.0)), 0.0)
    check_invariants(scheduler)
    assert priced == []


def _step(scheduler, worker):
    plan = scheduler.schedule(0.0)
    if plan is not None:
        scheduler.apply(worker.step(plan), 0.0)
    check_invariants(scheduler)


def test_forced_fifo_rounds_admit_the_oldest_under_priority():
    # Review finding 4: the queue is sorted by priority, so a "FIFO" round took the same
    # high-priority head and the old low-priority request never started.
    geometry = make_geometry(num_kv_blocks=256)
    scheduler = make_scheduler(
        geometry, admission_policy="priority", force_fifo_every=2, max_num_batched_tokens=8
    )
    worker = FakeWorker(geometry)
    scheduler.add(make_request("low", 8, max_new_tokens=1, priority=9), 0.0)
    low = scheduler.core._requests["low"]
    for index in range(150):
        for arrival in range(2):
            scheduler.add(make_request(f"h{index}.{arrival}", 8, max_new_tokens=1), 0.0)
        _step(scheduler, worker)
        if low.state is not RequestState.WAITING:
            break
    assert low.state is not RequestState.WAITING


def test_pack_reserves_a_head_that_a_forced_round_could_not_fit():
    # Review finding 5: without chunked prefill a forced round sees only what decodes
    # leave, so a 60-token head under a 64-token budget lost every forced round.
    geometry = make_geometry(num_kv_blocks=1024)
    scheduler = make_scheduler(
        geometry,
        admission_policy="pack",
        force_fifo_every=2,
        chunked_prefill=False,
        max_num_batched_tokens=64,
    )
    worker = FakeWorker(geometry)
    scheduler.add(make_request("long", 60, max_new_tokens=1), 0.0)
    for index in range(10):
        scheduler.add(make_request(f"first{index}", 4, max_new_tokens=8), 0.0)
    long = scheduler.core._requests["long"]
    for index in range(100):
        for arrival in range(3):
            scheduler.add(make_request(f"s{index}.{arrival}", 4, max_new_tokens=8), 0.0)
        _step(scheduler, worker)
        if long.state is not RequestState.WAITING:
            break
    assert long.state is not RequestState.WAITING


def test_pack_forces_fifo_every_fourth_round_by_default():
    assert SchedulerConfig(admission_policy="pack").fifo_every == 4
    assert SchedulerConfig(admission_policy="pack", force_fifo_every=0).fifo_every == 0
    assert SchedulerConfig(admission_policy="fifo").fifo_every == 0
