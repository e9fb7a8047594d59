"""A request that makes the worker's whole step fail is found and ends alone with ERROR."""

from __future__ import annotations

from collections import defaultdict

import pytest

from pagoda.scheduler_svc.core import FinishReason, Scheduler, SchedulerConfig
from pagoda.scheduler_svc.core.request import RequestState
from pagoda.scheduler_svc.output_processor import OutputProcessor
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import (
    LetterDetokenizer,
    Stream,
    TextScheduler,
    check_invariants,
    expected_generation,
    make_geometry,
    make_request,
    make_scheduler,
)

POISON = 5000  # beyond the vocabulary, so the dummy model never samples it
GEOMETRY = make_geometry(num_kv_blocks=64, block_size=4, vocab_size=POISON + 1)
# A lane whose worker holds every request it is given at once: all are in its lost step.
LOST_GEOMETRY = make_geometry(num_kv_blocks=1024, block_size=4, vocab_size=POISON + 1)


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
    # Bisection: the mixed step of 6, the half of 3 holding it, then the poison request
    # alone twice (the other half and the innocent pair run once each).
    assert num_failed_steps == 4
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


def lanes_sharing_texts(*geometries) -> tuple[TextScheduler, TextScheduler]:
    """Two cores with an output processor each over shared text states, as the front runs
    them, so a request's text state follows it when it is handed over."""
    texts: dict = {}
    lanes = []
    for geometry in geometries:
        core = Scheduler(SchedulerConfig())
        lane = TextScheduler(core, OutputProcessor(LetterDetokenizer, texts=texts))
        lane.attach_worker(geometry)
        lanes.append(lane)
    return lanes[0], lanes[1]


def lanes_after_a_loss(num_lost: int, num_own: int, lost_prompts=None):
    """Two schedulers as two lanes; the first loses its worker with a step of its
    `num_lost` requests in flight and hands them over, as suspects, to the second, which
    runs `num_own` requests of its own. Returns the healthy scheduler, its worker, the
    requests and the streams so far."""
    lost, healthy = lanes_sharing_texts(LOST_GEOMETRY, GEOMETRY)
    lost_worker, worker = FakeWorker(LOST_GEOMETRY), FakeWorker(GEOMETRY)
    prompts = lost_prompts or [20] * num_lost
    lost_requests = [
        make_request(f"a{i}", prompt, max_new_tokens=12, ignore_eos=True)
        for i, prompt in enumerate(prompts)
    ]
    own = [make_request(f"b{i}", 20, max_new_tokens=30, ignore_eos=True) for i in range(num_own)]
    for request in lost_requests:
        lost.add(request, 0.0)
    for request in own:
        healthy.add(request, 0.0)
    streams: dict[str, Stream] = defaultdict(Stream)
    for t in range(3):
        for scheduler, w in ((lost, lost_worker), (healthy, worker)):
            for output in scheduler.apply(w.step(scheduler.schedule(float(t))), t + 0.5):
                streams[output.request_id].take(output)
    lost.schedule(3.0)  # in flight when the worker goes away
    lost.detach_worker("its connection closed")
    requests, suspects = lost.core.hand_over()  # as Front._hand_over
    assert [s for s, _ in suspects] == [r.request_id for r in lost_requests]
    healthy.core.take_over(requests, suspects, 3.0)
    return healthy, worker, lost_requests + own, streams


def run_healthy_lane(healthy, worker, streams, start: int = 4):
    """Steps until the lane has no work, failing each step that feeds POISON; returns the
    longest run of steps, while suspects were isolated, in which the lane's own requests
    (b*) had work and got no token, and the number of failed steps. Checks that no step
    feeds suspects beside other requests."""
    stalled = longest_stall = num_failed = 0
    for step in range(start, start + 2000):
        plan = healthy.schedule(float(step))
        if plan is None:
            assert not healthy.has_work()
            return longest_stall, num_failed
        core = healthy.core
        isolating = core._isolation.active
        own_waits = any(r.startswith("b") for r in core._requests)
        # Suspects never share a step with others: a group step feeds only suspects.
        suspects = {r for group in core._isolation._groups for r in group}
        fed = {core._planner.running[s].request_id for s in plan.seq_ids}
        assert fed <= suspects if core._in_flight[-1].isolated else not fed & suspects
        if POISON in plan.token_ids:
            result = worker.fail(plan, "RuntimeError: poisoned")
            num_failed += 1
        else:
            result = worker.step(plan)
        outputs = healthy.apply(result, step + 0.5)
        own_streamed = any(output.request_id.startswith("b") for output in outputs)
        stalled = stalled + 1 if isolating and own_waits and not own_streamed else 0
        longest_stall = max(longest_stall, stalled)
        for output in outputs:
            streams[output.request_id].take(output)
        check_invariants(healthy)
    raise AssertionError("the lane never finished")


def assert_exact_streams(requests, streams, geometry) -> None:
    for request in requests:
        tokens, reason, _ = expected_generation(request, geometry)
        stream = streams[request.request_id]
        assert (stream.token_ids, stream.finish_reason) == (tokens, reason), request.request_id


@pytest.mark.parametrize("num_lost", [6, 24, 100])
def test_a_lost_lane_s_suspects_do_not_freeze_the_healthy_lane(num_lost):
    # Review s3 R7: each suspect ran alone, so the healthy lane's own 6 streams got no
    # token for 6 steps (200 suspects: 200 steps).
    healthy, worker, requests, streams = lanes_after_a_loss(num_lost, num_own=6)
    longest_stall, num_failed = run_healthy_lane(healthy, worker, streams)
    assert longest_stall <= 1, f"the own streams got no token for {longest_stall} steps"
    assert num_failed == 0
    # Halves that fit the pool rather than one step per suspect.
    assert healthy.stats.num_isolated_steps < num_lost
    assert_exact_streams(requests, streams, GEOMETRY)


def test_a_poison_request_among_handed_over_suspects_still_fails_alone():
    prompts = [20] * 8
    prompts[5] = [5, 6, POISON, 7]
    healthy, worker, requests, streams = lanes_after_a_loss(8, num_own=4, lost_prompts=prompts)
    longest_stall, num_failed = run_healthy_lane(healthy, worker, streams)
    poison, others = requests[5], requests[:5] + requests[6:]
    # It streamed on the lost worker (which it did not kill); it kills this one.
    assert streams[poison.request_id].finish_reason is FinishReason.ERROR
    tokens, _, _ = expected_generation(poison, GEOMETRY)
    assert (
        tokens[: len(streams[poison.request_id].token_ids)] == streams[poison.request_id].token_ids
    )
    assert_exact_streams(others, streams, GEOMETRY)
    # 8 suspects: the half of 4 holding it, then of 2, then alone twice.
    assert num_failed == 4
    assert longest_stall <= 1
