"""Overlapped steps in the scheduler core: step N+1 planned and run while N's result is
pending, against the plan-checking FakeWorker (which substitutes last_sampled_rows as the
real worker does). Every stream must equal what the request gives alone, serially."""

from __future__ import annotations

from collections import defaultdict, deque

import pytest

from pagoda.common.plan_check import PlanError
from pagoda.scheduler_svc.core import FinishReason, StepPlan
from pagoda.scheduler_svc.core.request import RequestState
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import (
    Stream,
    check_invariants,
    drive,
    expected_generation,
    make_geometry,
    make_request,
    make_scheduler,
)

EOS = 2


def drive_overlapped(scheduler, worker, streams=None, *, max_steps=10_000, on_plan=None):
    """As the overlapping step loop: plan N+1 as soon as N is sent, the worker runs each
    plan when it is sent (so N+1 runs before the scheduler has applied N), results are
    applied in order."""
    streams = streams if streams is not None else defaultdict(Stream)
    in_flight: deque = deque()
    num_ahead = 0
    for step in range(max_steps):
        now = float(step)
        if not in_flight or scheduler.can_plan_ahead:
            plan = scheduler.schedule(now, ahead=bool(in_flight))
            if plan is not None:
                num_ahead += bool(in_flight)
                check_ahead_rows(plan, in_flight[0][0] if in_flight else None)
                if on_plan is not None:
                    on_plan(plan, [p for p, _ in in_flight])
                in_flight.append((plan, worker.step(plan)))
                if len(in_flight) == 1:
                    continue  # plan the next one at once, as the loop does
        if not in_flight:
            assert not scheduler.has_work(), "work left but nothing scheduled"
            return streams, num_ahead
        _, result = in_flight.popleft()
        for output in scheduler.apply(result, now + 0.5):
            streams[output.request_id].take(output)
        check_invariants(scheduler)
    raise AssertionError(f"not done after {max_steps} steps")


def check_ahead_rows(plan: StepPlan, previous: StepPlan | None) -> None:
    """A row fed ahead is a sequence that samples in the step in flight (a prefill chunk
    that does not sample is never one), feeding one token at the position that sample
    takes; no other row is."""
    rows = plan.last_sampled_rows
    if previous is None:
        assert not rows
        return
    ends = {
        seq_id: previous.start_positions[i]
        + previous.token_offsets[i + 1]
        - previous.token_offsets[i]
        for i, seq_id in enumerate(previous.seq_ids)
        if previous.sample[i]
    }
    for row in rows:
        seq_id = plan.seq_ids[row]
        assert plan.token_offsets[row + 1] - plan.token_offsets[row] == 1
        assert ends.get(seq_id) == plan.start_positions[row], (seq_id, ends.get(seq_id))
    for row, seq_id in enumerate(plan.seq_ids):
        if row not in rows and seq_id in ends:  # sampled in flight, fed without its token
            raise AssertionError(f"seq {seq_id} is fed ahead without a last_sampled row")


def assert_exact(streams, requests, geometry):
    for request in requests:
        token_ids, finish_reason, text = expected_generation(request, geometry)
        stream = streams[request.request_id]
        assert stream.token_ids == token_ids, request.request_id
        assert (stream.finish_reason, stream.text) == (finish_reason, text), request.request_id
        assert stream.num_events_after_finish == 0


def mixed_requests(geometry):
    """EOS stops, length limits, a stop string, shared prompts (prefix hits), a long prompt
    chunked in, logprobs: every way a sequence can end or wait."""
    requests = [
        make_request(f"r{i}", 5 + 3 * i, max_new_tokens=9 + 4 * i, ignore_eos=i % 3 == 0)
        for i in range(8)
    ]
    shared = list(range(40, 60))
    requests += [make_request(f"s{i}", shared, max_new_tokens=7 + i) for i in range(3)]
    requests.append(make_request("long", 70, max_new_tokens=12, ignore_eos=True))
    requests.append(make_request("lp", 6, max_new_tokens=8, num_logprobs=2))
    text = expected_generation(requests[1], geometry)[2]
    requests.append(make_request("stop", requests[1].prompt_token_ids, stop_strings=(text[4:6],),
                                 max_new_tokens=30))  # fmt: skip
    return requests


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"max_num_batched_tokens": 24, "chunked_prefill": True},
        {"decode_first": False, "max_num_batched_tokens": 32},
        {"prefix_caching": False},
        {"admission_policy": "priority"},
    ],
)
@pytest.mark.parametrize("num_kv_blocks", [64, 24])  # 24: preemptions
def test_overlapped_streams_equal_serial_ones(knobs, num_kv_blocks):
    geometry = make_geometry(num_kv_blocks=num_kv_blocks, block_size=4, eos_token_ids=[EOS],
                             vocab_size=100)  # fmt: skip
    requests = mixed_requests(geometry)
    serial, overlapped = make_scheduler(geometry, **knobs), make_scheduler(geometry, **knobs)
    for request in requests:
        serial.add(request, 0.0)
        overlapped.add(request, 0.0)
    serial_streams = drive(serial, FakeWorker(geometry))
    streams, num_ahead = drive_overlapped(overlapped, FakeWorker(geometry))
    assert num_ahead > 10  # most steps were planned ahead
    assert_exact(streams, requests, geometry)
    assert {r: s.token_ids for r, s in streams.items()} == {
        r: s.token_ids for r, s in serial_streams.items()
    }
    stats = overlapped.stats
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)
    if num_kv_blocks == 24:
        assert stats.num_preemptions > 0


def sampling_seq_ids(plan: StepPlan) -> set[int]:
    return {s for s, sample in zip(plan.seq_ids, plan.sample, strict=True) if sample}


def test_a_decode_fed_ahead_names_its_row_and_feeds_no_token_of_its_own():
    geometry = make_geometry(block_size=4)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    scheduler.add(make_request("a", 6, max_new_tokens=8), 0.0)
    first = scheduler.schedule(0.0)
    assert scheduler.can_plan_ahead
    with pytest.raises(RuntimeError, match="in flight"):
        scheduler.schedule(0.0)  # only when asked for
    second = scheduler.schedule(0.0, ahead=True)
    assert second.seq_ids == first.seq_ids and second.last_sampled_rows == [0]
    assert second.start_positions == [6] and not second.new_sequences
    assert not scheduler.can_plan_ahead  # two in flight
    results = [worker.step(first), worker.step(second)]
    outputs = [list(scheduler.apply(result, 1.0)) for result in results]
    expected = expected_generation(make_request("a", 6, max_new_tokens=8), geometry)[0]
    assert [o.token_ids for step in outputs for o in step] == [[t] for t in expected[:2]]


def test_a_finish_in_n_drops_the_token_of_n_plus_1_and_frees_its_blocks():
    geometry = make_geometry(block_size=4, eos_token_ids=[EOS], vocab_size=100)
    # A request that ends on EOS, and one that runs on beside it.
    ending = next(
        request
        for request in (make_request(f"e{i}", 5, max_new_tokens=40) for i in range(200))
        if expected_generation(request, geometry)[1] is FinishReason.STOP
    )
    expected = expected_generation(ending, geometry)[0]
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    scheduler.add(ending, 0.0)
    scheduler.add(make_request("other", 5, max_new_tokens=60, ignore_eos=True), 0.0)
    dropped: list[tuple[int, int]] = []  # (step, seq_id) of rows fed after the ending token

    def on_plan(plan, in_flight):
        request = scheduler.core._requests.get("e" + ending.request_id[1:])
        if request is None or not in_flight or request.seq_id not in sampling_seq_ids(plan):
            return
        if len(request.token_ids) - request.num_prompt_tokens == len(expected) - 1:
            # N samples the EOS; N+1 is planned before that is known.
            assert plan.seq_ids.index(request.seq_id) in plan.last_sampled_rows
            dropped.append((plan.step_id, request.seq_id))

    streams, _ = drive_overlapped(scheduler, worker, on_plan=on_plan)
    assert len(dropped) == 1
    assert_exact(streams, [ending], geometry)
    assert streams[ending.request_id].finish_reason is FinishReason.STOP
    assert scheduler.stats.num_kv_blocks_used == 0


def test_a_request_whose_pending_token_is_its_last_is_not_decoded_ahead():
    geometry = make_geometry(block_size=4)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    scheduler.add(make_request("one", 3, max_new_tokens=1), 0.0)
    scheduler.add(make_request("more", 3, max_new_tokens=5), 0.0)
    first = scheduler.schedule(0.0)
    second = scheduler.schedule(0.0, ahead=True)
    more = scheduler.core._requests["more"].seq_id
    assert second.seq_ids == [more] and second.last_sampled_rows == [0]
    for result in (worker.step(first), worker.step(second)):
        scheduler.apply(result, 1.0)
    check_invariants(scheduler)


def test_a_stop_string_or_cancel_in_n_drops_the_token_of_n_plus_1():
    geometry = make_geometry(block_size=4)
    probe = make_request("s", 6, max_new_tokens=20, ignore_eos=True)
    text = expected_generation(probe, geometry)[2]
    stopping = make_request("s", 6, max_new_tokens=20, stop_strings=(text[3:5],), ignore_eos=True)
    cancelled = make_request("c", 6, max_new_tokens=20, ignore_eos=True)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    scheduler.add(stopping, 0.0)
    scheduler.add(cancelled, 0.0)
    streams: dict[str, Stream] = defaultdict(Stream)
    in_flight = deque([scheduler.schedule(0.0)])
    in_flight.append(scheduler.schedule(0.0, ahead=True))
    results = deque(worker.step(plan) for plan in in_flight)
    step = 0
    while in_flight:
        step += 1
        in_flight.popleft()
        for output in scheduler.apply(results.popleft(), float(step)):
            streams[output.request_id].take(output)
        if step == 3:
            streams["c"].take(scheduler.cancel("c", float(step)))  # step 4 is in flight
        check_invariants(scheduler)
        plan = scheduler.schedule(float(step), ahead=True)
        if plan is not None:
            in_flight.append(plan)
            results.append(worker.step(plan))
    assert_exact(streams, [stopping], geometry)
    c_tokens = expected_generation(cancelled, geometry)[0]
    assert streams["c"].finish_reason is FinishReason.CANCELLED
    assert streams["c"].token_ids == c_tokens[: len(streams["c"].token_ids)]
    assert len(streams["c"].token_ids) == 3 and streams["c"].num_events_after_finish == 0
    assert scheduler.stats.num_kv_blocks_used == 0


def test_a_worker_lost_with_two_steps_in_flight_requeues_both_and_loses_nothing():
    geometry = make_geometry(block_size=4)
    requests = [make_request(f"r{i}", 5 + i, max_new_tokens=10, ignore_eos=True) for i in range(4)]
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    for request in requests:
        scheduler.add(request, 0.0)
    streams = defaultdict(Stream)
    plan = scheduler.schedule(0.0)
    for output in scheduler.apply(worker.step(plan), 0.0):
        streams[output.request_id].take(output)
    first = scheduler.schedule(1.0)
    second = scheduler.schedule(1.0, ahead=True)
    assert second is not None and second.last_sampled_rows
    worker.step(first)  # both ran; their results are lost with the worker
    worker.step(second)
    assert scheduler.fail_step(first, "worker lost", 2.0) == []  # both count as never run
    assert scheduler.fail_step(second, "worker lost", 2.0) == []
    assert scheduler.num_in_flight == 0
    stats = scheduler.stats
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 4, 0)
    scheduler.detach_worker()
    scheduler.attach_worker(geometry)
    drive_overlapped(scheduler, FakeWorker(geometry), streams)
    assert_exact(streams, requests, geometry)


def test_a_failed_step_fails_the_one_after_it_and_isolation_runs_alone():
    geometry = make_geometry(block_size=4)
    requests = [make_request(f"r{i}", 5 + i, max_new_tokens=8, ignore_eos=True) for i in range(3)]
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    for request in requests:
        scheduler.add(request, 0.0)
    streams = defaultdict(Stream)
    plan = scheduler.schedule(0.0)
    for output in scheduler.apply(worker.step(plan), 0.0):
        streams[output.request_id].take(output)
    failing = scheduler.schedule(1.0)
    ahead = scheduler.schedule(1.0, ahead=True)
    failed = worker.fail(failing, "CUDA error")  # the worker forgets failing's sequences...
    with pytest.raises(PlanError):  # ...so the step after it cannot run them
        worker.step(ahead)
    assert not scheduler.apply(failed, 2.0)
    assert scheduler.num_in_flight == 0  # ahead counts as failed too
    # Isolation: the 3 suspects in halves (2, then 1), one step at a time.
    plan = scheduler.schedule(3.0)
    assert len(plan.seq_ids) == 2 and not scheduler.can_plan_ahead
    for output in scheduler.apply(worker.step(plan), 3.0):
        streams[output.request_id].take(output)
    drive_overlapped(scheduler, worker, streams)
    assert_exact(streams, requests, geometry)


def test_a_refusal_in_n_recomputes_only_the_tainted_rows_of_n_plus_1():
    """sched s3 R8: the worker refuses Z in N while N+1, already sent, decodes everyone
    ahead. N+1 must keep the rows of the others (their tokens stream when it answers);
    only Z's row and those that read Z's blocks (Y, a prefix hit on them in N+1) go."""
    geometry = make_geometry(num_kv_blocks=64, block_size=4, vocab_size=1000)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry, overlapped=True)
    decoders = [make_request(f"d{i}", 5 + i, max_new_tokens=8, ignore_eos=True) for i in range(3)]
    for request in decoders:
        scheduler.add(request, 0.0)
    streams: dict[str, Stream] = defaultdict(Stream)
    for output in scheduler.apply(worker.step(scheduler.schedule(0.0)), 0.5):
        streams[output.request_id].take(output)
    prefix = list(range(10, 18))  # two full blocks, keyed by Z in N
    z = make_request("Z", [*prefix, 99], max_new_tokens=4, ignore_eos=True)
    y = make_request("Y", [*prefix, 77], max_new_tokens=4, ignore_eos=True)
    scheduler.add(z, 1.0)
    step_n = scheduler.schedule(1.0)
    scheduler.add(y, 1.0)
    step_n1 = scheduler.schedule(1.0, ahead=True)
    requests = scheduler.core._requests
    z_seq, y_seq = requests["Z"].seq_id, requests["Y"].seq_id
    assert y_seq in step_n1.seq_ids and requests["Y"].num_cached_prompt_tokens == 8
    decoder_seqs = {requests[r.request_id].seq_id for r in decoders}
    assert decoder_seqs <= set(step_n1.seq_ids)
    result_n = worker.step(step_n, refuse={z_seq})  # the worker runs both before N answers
    result_n1 = worker.step(step_n1)
    assert z_seq in result_n1.errors  # it forgot Z: refused again, as a real worker does
    for output in scheduler.apply(result_n, 1.5):
        streams[output.request_id].take(output)
    check_invariants(scheduler)
    assert scheduler.num_in_flight == 1, "N+1 was failed whole"
    assert {requests[r.request_id].seq_id for r in decoders} == decoder_seqs
    assert requests["Y"].state is RequestState.WAITING  # it read K/V Z never wrote
    before = {r.request_id: len(streams[r.request_id].token_ids) for r in decoders}
    for output in scheduler.apply(result_n1, 2.0):
        streams[output.request_id].take(output)
    check_invariants(scheduler)
    assert all(len(streams[rid].token_ids) == n + 1 for rid, n in before.items())
    drive_overlapped(scheduler, worker, streams)
    assert streams["Z"].finish_reason is FinishReason.ERROR
    assert_exact(streams, [*decoders, y], geometry)


def test_after_a_failed_step_its_sequences_wait_in_front_of_the_next_steps_admissions():
    """sched s3 smell 10: N fails whole while N+1, which admitted c, is in flight. N's
    requests were admitted first: they go back to the head of the queue before c."""
    geometry = make_geometry(block_size=4)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    for name in "ab":
        scheduler.add(make_request(name, 5, max_new_tokens=8, ignore_eos=True), 0.0)
    scheduler.apply(worker.step(scheduler.schedule(0.0)), 0.5)
    failing = scheduler.schedule(1.0)
    scheduler.add(make_request("c", 5, max_new_tokens=8, ignore_eos=True), 1.0)
    ahead = scheduler.schedule(1.0, ahead=True)
    assert len(ahead.new_sequences) == 1
    scheduler.apply(worker.fail(failing, "CUDA error"), 2.0)
    check_invariants(scheduler)
    waiting = [request.request_id for request in scheduler.core._planner.waiting]
    assert waiting == ["a", "b", "c"]
    # The worker forgot a and b with the failed step: only c, which it still holds, is
    # forgotten by the next plan.
    assert scheduler.core._planner.forget_seq_ids == [ahead.new_sequences[0].seq_id]
