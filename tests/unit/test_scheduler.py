"""Scheduler scenarios against the in-process fake worker (which checks every plan)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest

from pagoda.scheduler_svc.core import (
    DuplicateRequestError,
    FinishReason,
    QueueFullError,
    RequestTooLargeError,
    StepPlan,
)
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


def fed(plan: StepPlan) -> dict[int, int]:
    """seq_id -> tokens fed in the plan."""
    offsets = plan.token_offsets
    return {s: offsets[i + 1] - offsets[i] for i, s in enumerate(plan.seq_ids)}


def step(scheduler, worker, now: float = 0.0):
    plan = scheduler.schedule(now)
    assert plan is not None
    outputs = scheduler.apply(worker.step(plan), now)
    check_invariants(scheduler)
    return plan, outputs


def seq_of(scheduler, request_id: str) -> int:
    return scheduler.core._requests[request_id].seq_id


def test_identical_prompts_in_one_admission_are_computed_once():
    geometry = make_geometry(block_size=4)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    prompt = list(range(10, 26))  # 16 tokens: 4 full blocks
    scheduler.add(make_request("a", prompt), 0.0)
    scheduler.add(make_request("b", prompt), 0.0)
    plan = scheduler.schedule(0.0)
    a, b = plan.new_sequences
    # b points at a's first three blocks and computes only the block holding the last token.
    assert fed(plan) == {a.seq_id: 16, b.seq_id: 4}
    assert b.cached_token_ids == prompt[:12]
    scheduler.apply(worker.step(plan), 0.0)
    assert worker.block_ids_of(b.seq_id)[:3] == worker.block_ids_of(a.seq_id)[:3]
    streams = drive(scheduler, worker)
    assert streams["a"].token_ids == streams["b"].token_ids


def test_prefix_hits_skip_computed_tokens():
    geometry = make_geometry(block_size=4)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    scheduler.add(make_request("first", prompt), 0.0)
    drive(scheduler, worker)
    scheduler.add(make_request("second", prompt[:12] + [99, 98]), 1.0)
    plan = scheduler.schedule(1.0)
    (new,) = plan.new_sequences
    assert plan.start_positions == [12] and new.cached_token_ids == prompt[:12]
    scheduler.apply(worker.step(plan), 1.0)
    streams = drive(scheduler, worker)
    assert streams["second"].usage.cached_prompt_tokens == 12
    stats = scheduler.stats
    assert (stats.num_prefix_queries_tokens, stats.num_prefix_hit_tokens) == (13 + 14, 12)


def test_blocks_filled_by_decoding_are_keyed_too():
    """A follow-up whose prompt is an earlier request's prompt and output (a chat's
    next turn) hits the blocks that request's decode steps filled, not only its prompt's."""
    geometry = make_geometry(block_size=4)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    prompt = list(range(10, 16))  # 6 tokens: one full block, and one filled by decoding
    scheduler.add(make_request("turn1", prompt, max_new_tokens=11, ignore_eos=True), 0.0)
    reply = drive(scheduler, worker)["turn1"].token_ids
    # 16 of the 17 tokens were fed, filling 4 blocks; the last was sampled, never fed.
    assert len(reply) == 11
    scheduler.add(make_request("turn2", prompt + reply + [99, 98]), 1.0)
    plan = scheduler.schedule(1.0)
    (new,) = plan.new_sequences
    assert new.cached_token_ids == (prompt + reply)[:16]


def test_the_last_prompt_token_is_always_computed():
    geometry = make_geometry(block_size=4)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    prompt = list(range(10, 18))  # exactly two blocks
    scheduler.add(make_request("first", prompt), 0.0)
    drive(scheduler, worker)
    scheduler.add(make_request("again", prompt), 1.0)
    plan = scheduler.schedule(1.0)
    assert plan.start_positions == [4] and plan.sample == [True]


def test_the_active_cap_clamps_admission_and_a_full_step_only_decodes():
    scheduler, worker = make_scheduler(max_active_requests=2), FakeWorker(make_geometry())
    for index in range(4):
        scheduler.add(make_request(f"r{index}", 6, max_new_tokens=3), 0.0)
    plan, _ = step(scheduler, worker)
    assert len(plan.new_sequences) == 2
    plan, _ = step(scheduler, worker)
    assert plan.new_sequences == [] and plan.num_decode_tokens == 2
    streams = drive(scheduler, worker)
    assert all(stream.finish_reason is FinishReason.LENGTH for stream in streams.values())


def test_the_prefill_batch_cap_and_the_prefill_token_cap():
    scheduler = make_scheduler(prefill_max_batch_size=2)
    for index in range(4):
        scheduler.add(make_request(f"r{index}", 4), 0.0)
    assert len(scheduler.schedule(0.0).new_sequences) == 2
    scheduler = make_scheduler(prefill_max_tokens=10)
    for index in range(4):
        scheduler.add(make_request(f"r{index}", 4), 0.0)
    assert scheduler.schedule(0.0).num_prefill_tokens == 10  # two whole and a chunk of 2


def test_force_fifo_rounds_let_a_long_head_in():
    scheduler = make_scheduler(
        make_geometry(num_kv_blocks=256),
        admission_policy="pack",
        force_fifo_every=2,
        max_num_batched_tokens=32,
    )
    worker = FakeWorker(make_geometry(num_kv_blocks=256))
    scheduler.add(make_request("long", 200, max_new_tokens=1), 0.0)
    for index in range(10):
        scheduler.add(make_request(f"short{index}", 4, max_new_tokens=8), 0.0)
    first, _ = step(scheduler, worker)  # round 1, pack: the cheap ones
    assert seq_of(scheduler, "long") is None and len(first.new_sequences) == 8
    step(scheduler, worker)  # round 2, FIFO: the head's first chunk
    assert scheduler.core._requests["long"].state is RequestState.RUNNING


def test_round_robin_decode_under_a_decode_cap():
    scheduler, worker = make_scheduler(max_decode_batch_size=2), FakeWorker(make_geometry())
    for index in range(5):
        scheduler.add(make_request(f"r{index}", 4, max_new_tokens=20), 0.0)
    step(scheduler, worker)  # all five prefill and sample once
    decoded: dict[int, int] = {}
    for _ in range(10):
        plan, _ = step(scheduler, worker)
        assert len(plan.seq_ids) == 2
        for seq_id in plan.seq_ids:
            decoded[seq_id] = decoded.get(seq_id, 0) + 1
    assert sorted(decoded.values()) == [4, 4, 4, 4, 4]


def test_chunked_prefill_continues_a_prompt_before_new_admissions():
    scheduler, worker = make_scheduler(max_num_batched_tokens=16), FakeWorker(make_geometry())
    scheduler.add(make_request("long", 40), 0.0)
    first, _ = step(scheduler, worker)
    assert first.sample == [False] and first.num_prefill_tokens == 16
    scheduler.add(make_request("short", 4), 0.0)
    second, _ = step(scheduler, worker)
    assert second.seq_ids[0] == first.seq_ids[0] and second.start_positions[0] == 16
    assert second.num_tokens == 16 and len(second.new_sequences) == 0
    third, _ = step(scheduler, worker)  # 8 tokens of the long one left, then the short one
    assert fed(third)[first.seq_ids[0]] == 8 and len(third.new_sequences) == 1


def test_no_decode_waits_while_a_long_prompt_is_chunked_in():
    geometry = make_geometry(num_kv_blocks=128)
    scheduler, worker = make_scheduler(geometry, max_num_batched_tokens=16), FakeWorker(geometry)
    for index in range(5):
        scheduler.add(make_request(f"d{index}", 3, max_new_tokens=40, ignore_eos=True), 0.0)
    first, _ = step(scheduler, worker)  # the five are admitted and start decoding
    decoders = set(first.seq_ids)
    scheduler.add(make_request("long", 100, max_new_tokens=2), 0.0)
    num_chunks = 0
    while True:
        plan, _ = step(scheduler, worker)
        counts = fed(plan)
        assert all(counts[seq_id] == 1 for seq_id in decoders)  # every decoder, every step
        assert plan.num_tokens <= 16
        long_ids = set(counts) - decoders
        if not long_ids or plan.sample[plan.seq_ids.index(long_ids.pop())]:
            break
        num_chunks += 1
    assert num_chunks >= 9  # 100 prompt tokens through the 11 left after 5 decodes


def test_without_chunked_prefill_a_prompt_is_whole_or_waits():
    scheduler, worker = (
        make_scheduler(max_num_batched_tokens=16, chunked_prefill=False),
        FakeWorker(make_geometry()),
    )
    scheduler.add(make_request("a", 10), 0.0)
    scheduler.add(make_request("b", 10), 0.0)
    first, _ = step(scheduler, worker)
    assert first.num_tokens == 10  # b would need 10 of the 6 left: it waits
    scheduler.add(make_request("huge", 40), 0.0)
    streams = drive(scheduler, worker)
    assert {s.finish_reason for s in streams.values()} == {FinishReason.LENGTH}


def test_decode_first_decides_when_prefill_and_decode_cannot_share():
    for decode_first, expect_admitted in ((True, False), (False, True)):
        geometry = make_geometry()
        scheduler = make_scheduler(
            geometry, max_num_batched_tokens=12, chunked_prefill=False, decode_first=decode_first
        )
        worker = FakeWorker(geometry)
        for index in range(4):
            scheduler.add(make_request(f"d{index}", 2, max_new_tokens=10), 0.0)
        step(scheduler, worker)
        scheduler.add(make_request("prompt", 10), 0.0)
        plan, _ = step(scheduler, worker)
        assert bool(plan.new_sequences) is expect_admitted
        assert plan.num_tokens <= 12


def test_preemption_takes_the_most_recently_admitted_and_output_is_unchanged():
    geometry = make_geometry(num_kv_blocks=6, block_size=4)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    requests = [make_request(f"r{i}", 4, max_new_tokens=12) for i in range(3)]
    for request in requests:
        scheduler.add(request, 0.0)
    streams = drive(scheduler, worker)
    assert scheduler.stats.num_preemptions > 0
    for request in requests:
        assert streams[request.request_id].token_ids == expected_generation(request, geometry)[0]


def test_priority_preempts_the_lowest_priority_first():
    geometry = make_geometry(num_kv_blocks=5, block_size=4)
    scheduler = make_scheduler(geometry, admission_policy="priority")
    worker = FakeWorker(geometry)
    low = make_request("low", 4, max_new_tokens=8, priority=9)
    high = make_request("high", 4, max_new_tokens=8, priority=0)
    streams = defaultdict(Stream)
    scheduler.add(low, 0.0)
    drive(scheduler, worker, streams, max_steps=1, stop_early=True)  # low runs first
    scheduler.add(high, 1.0)  # high is admitted later: the most recent
    state = scheduler.core._requests
    while state["high"].num_preemptions == 0 and state["low"].num_preemptions == 0:
        drive(scheduler, worker, streams, max_steps=1, stop_early=True)
    assert state["low"].num_preemptions == 1 and state["high"].num_preemptions == 0
    drive(scheduler, worker, streams)
    for request in (low, high):
        assert streams[request.request_id].token_ids == expected_generation(request, geometry)[0]


def test_priority_admits_lower_values_first():
    scheduler = make_scheduler(admission_policy="priority", max_active_requests=1)
    scheduler.add(make_request("later", 4, priority=5), 0.0)
    scheduler.add(make_request("sooner", 4, priority=1), 0.0)
    scheduler.schedule(0.0)
    assert scheduler.core._requests["sooner"].state is RequestState.RUNNING


@pytest.mark.parametrize(("policy", "first"), [("fifo", "cold"), ("prefix", "warm")])
def test_prefix_admits_the_longest_cached_prefix_first(policy, first):
    """A finished request leaves its prompt's blocks cached; of two waiting requests, the
    one that shares that prompt starts first under prefix, the older one under fifo."""
    geometry = make_geometry(num_kv_blocks=64, block_size=4)
    scheduler = make_scheduler(geometry, admission_policy=policy, max_active_requests=1)
    worker = FakeWorker(geometry)
    shared = list(range(10, 26))  # four blocks
    scheduler.add(make_request("seed", shared, max_new_tokens=1), 0.0)
    drive(scheduler, worker)
    scheduler.add(make_request("cold", 16, max_new_tokens=1), 1.0)
    scheduler.add(make_request("warm", [*shared, 90, 91], max_new_tokens=1), 1.0)
    scheduler.schedule(2.0)
    assert scheduler.core._requests[first].state is RequestState.RUNNING


@pytest.mark.parametrize(("policy", "order"), [("fifo", "abc"), ("deadline", "cba")])
def test_deadline_admits_the_caller_that_gives_up_first(policy, order):
    """One request runs at a time. Of three waiting, "a" has no deadline, "b" a late one
    and "c", the newest, the earliest (added a second later, with less time left): under
    deadline they start c, b, a; under fifo in arrival order."""
    scheduler = make_scheduler(admission_policy=policy, max_active_requests=1)
    worker = FakeWorker(make_geometry())
    scheduler.add(make_request("a", 8, max_new_tokens=2), 0.0)
    scheduler.add(
        dataclasses.replace(make_request("b", 8, max_new_tokens=2), time_limit_s=30.0), 0.0
    )
    scheduler.add(
        dataclasses.replace(make_request("c", 8, max_new_tokens=2), time_limit_s=9.0), 1.0
    )
    started = []
    drive(
        scheduler,
        worker,
        on_step=lambda _, plan: started.extend(
            scheduler.core._planner.running[new.seq_id].request_id for new in plan.new_sequences
        ),
    )
    assert "".join(started) == order


def test_a_cancel_frees_blocks_at_once_and_is_forgotten_by_the_next_plan():
    geometry = make_geometry()
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    scheduler.add(make_request("gone", 8, max_new_tokens=50), 0.0)
    scheduler.add(make_request("stays", 8, max_new_tokens=50), 0.0)
    step(scheduler, worker)
    seq_id = seq_of(scheduler, "gone")
    used_before = scheduler.stats.num_kv_blocks_used
    output = scheduler.cancel("gone", 1.0)
    assert output.finish_reason is FinishReason.CANCELLED and output.usage.completion_tokens == 1
    assert scheduler.stats.num_kv_blocks_used < used_before
    check_invariants(scheduler)
    plan, _ = step(scheduler, worker)
    assert plan.forget_seq_ids == [seq_id] and seq_id not in worker.live_seq_ids
    assert scheduler.cancel("gone", 2.0) is None and scheduler.cancel("unknown", 2.0) is None


def test_cancelling_a_waiting_request():
    scheduler = make_scheduler(max_active_requests=1)
    scheduler.add(make_request("a", 4), 0.0)
    scheduler.add(make_request("b", 4), 0.0)
    assert scheduler.cancel("b", 0.5).finish_reason is FinishReason.CANCELLED
    assert scheduler.stats.num_waiting == 1


def test_add_refuses_a_full_queue_a_duplicate_and_what_can_never_fit():
    scheduler = make_scheduler(
        make_geometry(num_kv_blocks=4, block_size=4, max_context_tokens=64), max_waiting_requests=2
    )
    scheduler.add(make_request("a", 4), 0.0)
    with pytest.raises(DuplicateRequestError):
        scheduler.add(make_request("a", 4), 0.0)
    with pytest.raises(RequestTooLargeError, match="exceeds the context of 64 tokens"):
        scheduler.add(make_request("long", 60, max_new_tokens=8), 0.0)
    with pytest.raises(RequestTooLargeError, match="needs 5 KV blocks of 4 tokens"):
        scheduler.add(make_request("big", 16, max_new_tokens=2), 0.0)
    scheduler.add(make_request("fits", 16, max_new_tokens=1), 0.0)  # the last token needs no slot
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        scheduler.add(make_request("c", 4), 0.0)


def test_a_failed_step_recomputes_without_losing_or_repeating_tokens():
    geometry = make_geometry()
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    requests = [make_request(f"r{i}", 6, max_new_tokens=6) for i in range(3)]
    for request in requests:
        scheduler.add(request, 0.0)
    streams = drive(scheduler, worker, max_steps=2, stop_early=True)
    plan = scheduler.schedule(2.0)  # lost with the worker: the plan never ran
    assert scheduler.fail_step(plan, "worker lost", 2.0) == []
    check_invariants(scheduler)
    assert scheduler.stats.num_running == 0 and scheduler.stats.num_waiting == 3
    plan = scheduler.schedule(3.0)  # ran, but the forward raised
    assert not scheduler.apply(worker.fail(plan, "CUDA error"), 3.0)
    drive(scheduler, worker, streams)
    for request in requests:
        assert streams[request.request_id].token_ids == expected_generation(request, geometry)[0]
        assert streams[request.request_id].num_events_after_finish == 0


def test_a_sequence_error_ends_only_that_request():
    geometry = make_geometry()
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    scheduler.add(make_request("bad", 4), 0.0)
    scheduler.add(make_request("good", 4), 0.0)
    plan = scheduler.schedule(0.0)
    result = worker.step(plan)
    bad = seq_of(scheduler, "bad")
    index = result.seq_ids.index(bad)
    del result.seq_ids[index], result.token_ids[index]
    result.errors[bad] = "block id out of range"
    outputs = {o.request_id: o for o in scheduler.apply(result, 0.0)}
    assert outputs["bad"].finish_reason is FinishReason.ERROR
    assert "block id out of range" in outputs["bad"].error_message
    assert outputs["good"].finish_reason is None
    check_invariants(scheduler)


def test_a_missing_sample_is_an_error_not_a_hang():
    geometry = make_geometry()
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    scheduler.add(make_request("a", 4), 0.0)
    result = worker.step(scheduler.schedule(0.0))
    result.seq_ids.clear()
    result.token_ids.clear()
    (output,) = scheduler.apply(result, 0.0)
    assert output.finish_reason is FinishReason.ERROR and not scheduler.has_work()


def test_detach_and_attach_recompute_the_running_requests():
    geometry = make_geometry()
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    requests = [make_request(f"r{i}", 5, max_new_tokens=6) for i in range(3)]
    for request in requests:
        scheduler.add(request, 0.0)
    _, early = step(scheduler, worker)
    scheduler.detach_worker()
    assert not scheduler.worker_attached and scheduler.schedule(1.0) is None
    assert scheduler.stats.num_waiting == 3
    assert scheduler.attach_worker(geometry) == []
    streams = drive(scheduler, FakeWorker(geometry))
    for request in requests:
        first = [o.token_ids[0] for o in early if o.request_id == request.request_id]
        assert (
            first + streams[request.request_id].token_ids
            == expected_generation(request, geometry)[0]
        )


def test_a_smaller_worker_ends_what_it_can_never_hold():
    scheduler = make_scheduler(make_geometry(num_kv_blocks=64))
    scheduler.add(make_request("big", 40, max_new_tokens=8), 0.0)
    scheduler.add(make_request("small", 4), 0.0)
    (output,) = scheduler.attach_worker(make_geometry(num_kv_blocks=4))
    assert output.request_id == "big" and output.finish_reason is FinishReason.ERROR
    assert scheduler.stats.num_waiting == 1


def test_a_late_result_is_ignored_and_one_step_is_in_flight_at_a_time():
    geometry = make_geometry()
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    scheduler.add(make_request("a", 4), 0.0)
    plan = scheduler.schedule(0.0)
    with pytest.raises(RuntimeError, match="in flight"):
        scheduler.schedule(0.0)
    result = worker.step(plan)
    scheduler.fail_step(plan, "timed out", 1.0)
    assert not scheduler.apply(result, 1.0)


def test_logprobs_usage_and_timings():
    geometry = make_geometry()
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    scheduler.add(make_request("a", 4, max_new_tokens=2, num_logprobs=2), 10.0)
    scheduler.add(make_request("plain", 4, max_new_tokens=2), 10.0)
    outputs = []
    for now in (11.0, 12.0):
        outputs += scheduler.apply(worker.step(scheduler.schedule(now)), now + 0.5)
    a = [o for o in outputs if o.request_id == "a"]
    assert all(len(o.logprobs) == 1 and len(o.logprobs[0].top_token_ids) == 2 for o in a)
    assert a[0].logprobs[0].token_id == a[0].token_ids[0]
    assert all(o.logprobs is None for o in outputs if o.request_id == "plain")
    last = a[-1]
    assert last.usage.prompt_tokens == 4 and last.usage.completion_tokens == 2
    assert (last.timings.queued_ms, last.timings.first_token_ms, last.timings.total_ms) == (
        1000.0,
        1500.0,
        2500.0,
    )


def test_stats_count_blocks_steps_and_finishes():
    geometry = make_geometry(num_kv_blocks=32)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    scheduler.add(make_request("a", 9, max_new_tokens=3), 0.0)
    drive(scheduler, worker)
    stats = scheduler.stats
    assert (stats.num_requests_finished, stats.num_generated_tokens, stats.num_steps) == (1, 3, 3)
    assert stats.num_kv_blocks_used == 0 and stats.num_kv_blocks_total == 32
    assert stats.num_kv_blocks_cached == 2  # the two full blocks stay for reuse
