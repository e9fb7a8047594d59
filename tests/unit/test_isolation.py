"""A request that makes the worker's whole step fail is found and ends alone with ERROR."""

from __future__ import annotations

from collections import defaultdict

import pytest
from pagoda.scheduler_svc.core import FinishReason
from pagoda.scheduler_svc.core.request import RequestState
from pagoda.scheduler_svc.testing import FakeWorker

from tests.unit.conftest import (
    Stream,
    check_invariants,
    expected_generation,
    make_geometry,
    make_request,
    make_scheduler,
)

POISON = 5000  # beyond the vocabulary, so the dummy model never samples it


def run_with_poison(scheduler, worker, max_steps: int = 2000):
    streams: dict[str, Stream] = defaultdict(Stream)
    num_failed_steps = 0
    for step in range(max_steps):
        plan = scheduler.schedule(now=float(step))
        if plan is None:
            assert not scheduler.has_work()
            return streams, num_failed_steps
        if POISON in plan.token_ids:
            result = worker.fail(plan, "RuntimeError: poisoned")
            num_failed_steps += 1
        else:
            result = worker.step(plan)
        for output in scheduler.apply(result, now=step + 0.5):
            streams[output.request_id].take(output)
        check_invariants(scheduler)
    raise AssertionError("the scheduler never finished: a poison request livelocks it")


def test_the_poison_request_alone_fails_and_the_others_finish_exactly():
    geometry = make_geometry(num_kv_blocks=64, block_size=4, vocab_size=1000)
    scheduler = make_scheduler(geometry, max_num_batched_tokens=64)
    worker = FakeWorker(geometry)
    good = [make_request(f"good{i}", 6 + i, max_new_tokens=8, ignore_eos=True) for i in range(5)]
    poison = make_request("poison", [5, 6, POISON, 7], max_new_tokens=8, ignore_eos=True)
    for request in [good[0], good[1], poison, *good[2:]]:
        scheduler.add(request, now=0.0)

    streams, num_failed_steps = run_with_poison(scheduler, worker)

    assert streams["poison"].finish_reason is FinishReason.ERROR
    assert streams["poison"].token_ids == []
    for request in good:
        tokens, reason, _ = expected_generation(request, geometry)
        assert streams[request.request_id].token_ids == tokens
        assert streams[request.request_id].finish_reason is reason
    # One failure of the mixed step, then two of the poison request run alone.
    assert num_failed_steps == 3
    assert scheduler.stats.num_kv_blocks_used == 0


def test_a_request_failing_alone_gets_one_more_try():
    geometry = make_geometry()
    scheduler = make_scheduler(geometry)
    worker = FakeWorker(geometry)
    scheduler.add(make_request("poison", [POISON, 4, 5], max_new_tokens=3), now=0.0)
    streams, num_failed_steps = run_with_poison(scheduler, worker)
    assert streams["poison"].finish_reason is FinishReason.ERROR
    assert num_failed_steps == 2


def test_a_passing_fault_costs_nothing():
    geometry = make_geometry()
    scheduler = make_scheduler(geometry)
    worker = FakeWorker(geometry)
    request = make_request("once", 6, max_new_tokens=5, ignore_eos=True)
    scheduler.add(request, now=0.0)
    scheduler.apply(worker.fail(scheduler.schedule(now=0.0)), now=0.5)  # fails once, alone
    streams, _ = run_with_poison(scheduler, worker)
    tokens, reason, _ = expected_generation(request, geometry)
    assert streams["once"].token_ids == tokens and streams["once"].finish_reason is reason


@pytest.mark.parametrize("how", ["error", "lost"])
def test_a_request_preempted_while_the_next_step_is_planned_stays_a_suspect(how):
    """sched s3 R9: planning N+1 ahead preempts the poison request P (the newest) while N,
    which fed it, runs; N then fails or loses the worker. P must be a suspect like the
    others, or it crashes one more mixed batch once the isolation is over."""
    geometry = make_geometry(num_kv_blocks=6, block_size=4, vocab_size=POISON + 1)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    scheduler.add(make_request("D", [7, 8, 9], max_new_tokens=12, ignore_eos=True), 0.0)
    scheduler.apply(worker.step(scheduler.schedule(0.0)), 0.5)  # D decodes at position 3
    scheduler.add(make_request("Z", list(range(10, 18)) + [99], max_new_tokens=3), 1.0)
    scheduler.add(make_request("P", [POISON] * 9, max_new_tokens=3), 1.0)
    step_n = scheduler.schedule(1.0)
    poison = scheduler.core._requests["P"]
    scheduler.schedule(1.0, ahead=True)  # D crosses into a new block: P is the victim
    assert poison.state is RequestState.WAITING
    streams: dict[str, Stream] = defaultdict(Stream)
    if how == "error":
        outputs = scheduler.apply(worker.fail(step_n, "RuntimeError: poisoned"), 1.5)
    else:
        outputs = scheduler.fail_step(step_n, "the worker died", 1.5)
        worker = FakeWorker(geometry)
        scheduler.core.detach_worker(suspect=False)
        scheduler.attach_worker(geometry)
    for output in outputs:
        streams[output.request_id].take(output)
    # From here on every plan that feeds P fails; none of them may feed anyone else.
    for step in range(2, 200):
        plan = scheduler.schedule(float(step))
        if plan is None:
            break
        fed = {r.request_id for r in scheduler.core._requests.values() if r.seq_id in plan.seq_ids}
        if POISON in plan.token_ids:
            assert fed == {"P"}, f"step {step}: the poison ran beside {fed - {'P'}}"
            result = worker.fail(plan, "RuntimeError: poisoned")
        else:
            result = worker.step(plan)
        for output in scheduler.apply(result, step + 0.5):
            streams[output.request_id].take(output)
        check_invariants(scheduler)
    assert streams["P"].finish_reason is FinishReason.ERROR
    for request_id in ("D", "Z"):
        assert streams[request_id].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
