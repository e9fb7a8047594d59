"""Blocks keyed by a sequence of the step in flight: when their writer is refused, nobody
keeps them (sched_review finding 1, issue 14 item 1)."""

from __future__ import annotations

from pagoda.scheduler_svc.core import FinishReason
from pagoda.scheduler_svc.core.request import RequestState
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import (
    check_invariants,
    drive,
    expected_generation,
    make_geometry,
    make_request,
    make_scheduler,
)

PREFIX = list(range(10, 22))  # 12 tokens: three full blocks of 4


def test_a_refused_writer_takes_the_sequences_sharing_its_blocks_back_to_recompute():
    geometry = make_geometry(block_size=4, vocab_size=1000)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    a = make_request("a", [*PREFIX, 30, 31], max_new_tokens=6, ignore_eos=True)
    b = make_request("b", [*PREFIX, 40], max_new_tokens=6, ignore_eos=True)
    scheduler.add(a, 0.0)
    scheduler.add(b, 0.0)
    plan = scheduler.schedule(0.0)
    requests = scheduler.core._requests
    seq_a, seq_b = requests["a"].seq_id, requests["b"].seq_id
    a_blocks = set(requests["a"].block_ids)
    # b's prefix hit is a's blocks of this very step: a computes them, b reads them.
    assert len(set(requests["b"].block_ids) & a_blocks) == 3
    assert plan.seq_ids == [seq_a, seq_b]

    # The worker refuses a before its forward (say, a token id of a smaller vocabulary):
    # a's blocks were never written, and b read garbage in place of the prefix.
    outputs = scheduler.apply(worker.step(plan, refuse={seq_a}), 1.0)
    check_invariants(scheduler)

    (ended,) = [o for o in outputs if o.finish_reason is not None]
    assert ended.request_id == "a" and ended.finish_reason is FinishReason.ERROR
    assert all(o.request_id != "b" for o in outputs), "b's token came from garbage K/V"
    state_b = requests["b"]
    assert state_b.state is RequestState.WAITING and state_b.block_ids == []
    blocks = scheduler.core._planner.blocks
    assert all(blocks.block_hash(block_id) is None for block_id in a_blocks)
    # b is forgotten by the worker and recomputes from scratch: its output is its own.
    streams = drive(scheduler, worker)
    assert seq_b not in worker.live_seq_ids
    tokens, reason, _ = expected_generation(b, geometry)
    assert streams["b"].token_ids == tokens and streams["b"].finish_reason is reason


def test_a_chain_of_same_step_sharers_all_recompute_and_unrelated_requests_go_on():
    """c shares b's blocks, b shares a's: a refused makes b and c garbage; d is apart."""
    geometry = make_geometry(block_size=4, vocab_size=1000)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    a = make_request("a", [*PREFIX[:4], 50], max_new_tokens=5, ignore_eos=True)
    b = make_request("b", [*PREFIX[:4], 50, 51, 52, 53, 54], max_new_tokens=5, ignore_eos=True)
    c = make_request("c", [*PREFIX[:4], 50, 51, 52, 53, 60], max_new_tokens=5, ignore_eos=True)
    d = make_request("d", [70, 71, 72, 73, 74, 75], max_new_tokens=5, ignore_eos=True)
    for request in (a, b, c, d):
        scheduler.add(request, 0.0)
    plan = scheduler.schedule(0.0)
    requests = scheduler.core._requests
    assert len(plan.seq_ids) == 4
    outputs = scheduler.apply(worker.step(plan, refuse={requests["a"].seq_id}), 1.0)
    check_invariants(scheduler)
    assert {o.request_id for o in outputs} == {"a", "d"}
    assert requests["b"].state is RequestState.WAITING
    assert requests["c"].state is RequestState.WAITING
    assert requests["d"].state is RequestState.RUNNING
    streams = drive(scheduler, worker)
    for request in (b, c):
        tokens, reason, _ = expected_generation(request, geometry)
        assert streams[request.request_id].token_ids == tokens
    tokens, _, _ = expected_generation(d, geometry)
    assert [o.token_ids[0] for o in outputs if o.request_id == "d"] + streams[
        "d"
    ].token_ids == tokens


def test_a_worker_with_a_smaller_vocabulary_ends_the_requests_it_cannot_read():
    big = make_geometry(vocab_size=1000)
    scheduler = make_scheduler(big)
    worker = FakeWorker(big)
    scheduler.add(make_request("running", [5, 6, 900], max_new_tokens=50, ignore_eos=True), 0.0)
    scheduler.add(make_request("fine", [5, 6, 7], max_new_tokens=3), 0.0)
    scheduler.add(make_request("queued", [*PREFIX, 700], max_new_tokens=3), 0.0)
    scheduler.core.schedule(0.0)
    scheduler.detach_worker()  # lost mid-step: everything waits for the next worker
    small = make_geometry(vocab_size=500)
    outputs = scheduler.attach_worker(small)
    assert sorted(o.request_id for o in outputs) == ["queued", "running"]
    for output in outputs:
        assert output.finish_reason is FinishReason.ERROR
        assert "outside the vocabulary of 500" in output.error_message
    check_invariants(scheduler)
    streams = drive(scheduler, FakeWorker(small))
    assert streams["fine"].finish_reason is not FinishReason.ERROR
    assert worker.num_steps == 0


def test_a_missing_sample_is_found_even_when_an_error_names_a_sequence_that_did_not_sample():
    """Review finding 11: an error on a non-sampling chunk must not hide a missing sample
    (the decoder would otherwise be fed its stale last token again)."""
    geometry = make_geometry(block_size=4)
    scheduler = make_scheduler(geometry, max_num_batched_tokens=8)
    worker = FakeWorker(geometry)
    scheduler.add(make_request("decoder", 4, max_new_tokens=20, ignore_eos=True), 0.0)
    drive(scheduler, worker, max_steps=1, stop_early=True)
    scheduler.add(make_request("chunked", 30, max_new_tokens=4), 0.0)
    plan = scheduler.schedule(1.0)
    requests = scheduler.core._requests
    decoder, chunked = requests["decoder"].seq_id, requests["chunked"].seq_id
    assert plan.sample == [seq_id == decoder for seq_id in plan.seq_ids]
    # The worker answers with an error for the chunk and nothing at all for the decoder.
    result = worker.step(plan, refuse={chunked})
    result.seq_ids.clear()
    result.token_ids.clear()
    outputs = {o.request_id: o for o in scheduler.apply(result, 1.5)}
    assert outputs["chunked"].finish_reason is FinishReason.ERROR
    assert outputs["decoder"].finish_reason is FinishReason.ERROR
    assert "no token" in outputs["decoder"].error_message
    check_invariants(scheduler)


# Overlapped mode (sched s3 R1): a same-step reader of a refused writer's blocks that is no
# longer running when the result comes back (cancelled, or preempted while step N+1 was
# planned) must lose its keys too: it computed its own blocks from K/V nobody wrote.

TAIL = [50, 51, 52, 53, 54]  # the reader's own block after the prefix (+1 token)


def add_writer_and_reader(scheduler, now: float = 0.0) -> None:
    scheduler.add(make_request("Z", [*PREFIX[:8], 99], max_new_tokens=3), now)
    scheduler.add(make_request("R", [*PREFIX[:8], *TAIL], max_new_tokens=3), now)


def test_a_reader_cancelled_while_its_step_runs_keeps_no_key_of_a_refused_writer():
    geometry = make_geometry(num_kv_blocks=64, block_size=4, vocab_size=1000)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    add_writer_and_reader(scheduler)
    plan = scheduler.schedule(0.0)
    requests = scheduler.core._requests
    z, r = requests["Z"], requests["R"]
    assert r.block_ids[:2] == z.block_ids[:2]  # R reads Z's blocks in the same step
    r_own_block = r.block_ids[2]
    scheduler.cancel("R", 0.1)  # the overlapped loop drains cancels while a step runs
    scheduler.apply(worker.step(plan, refuse={z.seq_id}), 0.5)
    check_invariants(scheduler)
    assert scheduler.core._planner.blocks.block_hash(r_own_block) is None


def test_no_later_prompt_is_served_the_block_a_cancelled_reader_computed_from_garbage():
    geometry = make_geometry(num_kv_blocks=64, block_size=4, vocab_size=1000)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    add_writer_and_reader(scheduler)
    plan = scheduler.schedule(0.0)
    scheduler.cancel("R", 0.1)
    scheduler.apply(worker.step(plan, refuse={scheduler.core._requests["Z"].seq_id}), 0.5)
    # The shared prefix is computed again by another request, then R's prompt comes back:
    # the checking worker raises PlanError if S is pointed at the garbage block.
    scheduler.add(make_request("Q", [*PREFIX[:8], 77], max_new_tokens=1), 1.0)
    drive(scheduler, worker)
    s = make_request("S", [*PREFIX[:8], *TAIL], max_new_tokens=3)
    scheduler.add(s, 3.0)
    streams = drive(scheduler, worker)
    tokens, reason, _ = expected_generation(s, geometry)
    assert streams["S"].token_ids == tokens and streams["S"].finish_reason is reason


def test_a_reader_preempted_while_the_next_step_is_planned_keeps_no_key_of_a_refused_writer():
    """No cancel: planning N+1 ahead preempts the reader (the newest admission) while N,
    whose writer the worker refuses, runs."""
    geometry = make_geometry(num_kv_blocks=6, block_size=4, vocab_size=1000)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    scheduler.add(make_request("D", [7, 8, 9], max_new_tokens=12, ignore_eos=True), 0.0)
    scheduler.apply(worker.step(scheduler.schedule(0.0)), 0.5)  # D decodes at position 3
    add_writer_and_reader(scheduler, 1.0)
    step_n = scheduler.schedule(1.0)  # D decodes, Z writes the prefix, R reads it
    core = scheduler.core
    z, r = core._requests["Z"], core._requests["R"]
    r_own_block = r.block_ids[2]
    assert core._planner.blocks.num_available_blocks == 0
    scheduler.schedule(1.0, ahead=True)  # D crosses into a new block: R is the victim
    assert r.state is RequestState.WAITING and core.stats.num_preemptions == 1
    scheduler.apply(worker.step(step_n, refuse={z.seq_id}), 1.5)
    check_invariants(scheduler)
    assert core._planner.blocks.block_hash(r_own_block) is None
