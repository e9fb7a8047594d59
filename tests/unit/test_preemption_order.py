"""Who is preempted when the pool runs out (sched_review findings 2, 3 and 11; issue 14
item 2): an admission never costs an older request its blocks, and under the priority
policy the lowest priority goes first even if it was already fed this step."""

from __future__ import annotations

from pagoda.scheduler_svc.core import FinishReason
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


def assert_exact(streams, requests, geometry) -> None:
    for request in requests:
        tokens, reason, _ = expected_generation(request, geometry)
        assert streams[request.request_id].token_ids == tokens, request.request_id
        assert streams[request.request_id].finish_reason is reason


class AdmissionsThatPreempt:
    """drive()'s on_step: the steps whose plan admitted a request and preempted one."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.num_preemptions = 0  # after the last plan: apply() never preempts
        self.steps: list[int] = []

    def __call__(self, step: int, plan) -> None:
        num_preemptions = self.scheduler.stats.num_preemptions
        if plan.new_sequences and num_preemptions > self.num_preemptions:
            self.steps.append(step)
        self.num_preemptions = num_preemptions


def test_without_decode_first_an_admission_never_preempts_in_its_own_step():
    """Review s2: two decoders reach a block boundary as a new prompt arrives that would
    take the last free blocks; admitting it must not preempt either of them."""
    geometry = make_geometry(num_kv_blocks=6, block_size=4)
    scheduler = make_scheduler(geometry, decode_first=False)
    worker = FakeWorker(geometry)
    old = [make_request(f"old{i}", 4, max_new_tokens=12, ignore_eos=True) for i in range(2)]
    for request in old:
        scheduler.add(request, 0.0)
    # Prefill (computed 4), then 4 decodes (computed 8): the next decode of each needs a
    # new block, and 2 of the 6 are free.
    drive(scheduler, worker, max_steps=5, stop_early=True)
    requests = scheduler.core._requests
    assert [requests[r.request_id].num_computed_tokens for r in old] == [8, 8]
    assert scheduler.stats.num_kv_blocks_used == 4
    scheduler.add(make_request("new", 8, max_new_tokens=4), 5.0)
    plan = scheduler.schedule(5.0)
    assert scheduler.stats.num_preemptions == 0
    assert plan.new_sequences == []  # it waits: the 2 free blocks are the decoders'
    scheduler.apply(worker.step(plan), 5.5)
    check_invariants(scheduler)


def test_without_decode_first_no_step_both_admits_and_preempts_and_outputs_stay_exact():
    geometry = make_geometry(num_kv_blocks=10, block_size=4)
    scheduler = make_scheduler(geometry, decode_first=False, max_num_batched_tokens=16)
    worker = FakeWorker(geometry)
    requests = [
        make_request(f"r{i}", 4 + 3 * i, max_new_tokens=14, ignore_eos=True) for i in range(5)
    ]
    watch = AdmissionsThatPreempt(scheduler)
    streams = None
    for step in range(0, 15, 3):
        scheduler.add(requests[step // 3], float(step))
        streams = drive(scheduler, worker, streams, max_steps=3, stop_early=True, on_step=watch)
    drive(scheduler, worker, streams, on_step=watch)
    assert watch.steps == []
    assert scheduler.stats.num_preemptions > 0  # the pool was contended
    assert_exact(streams, requests, geometry)


def test_a_high_priority_prefill_evicts_a_low_priority_decoder_not_itself():
    """Review s5: three priority-9 decoders hold the pool; a priority-0 prompt continuing
    its chunks must take their blocks rather than preempt itself over and over."""
    geometry = make_geometry(num_kv_blocks=12, block_size=4)
    scheduler = make_scheduler(
        geometry, admission_policy="priority", max_num_batched_tokens=8, prefill_max_tokens=8
    )
    worker = FakeWorker(geometry)
    low = [
        make_request(f"low{i}", 8, max_new_tokens=30, ignore_eos=True, priority=9) for i in range(3)
    ]
    for request in low:
        scheduler.add(request, 0.0)
    streams = drive(scheduler, worker, max_steps=5, stop_early=True)
    high = make_request("high", 24, max_new_tokens=4, ignore_eos=True, priority=0)
    scheduler.add(high, 5.0)
    state = scheduler.core._requests
    high_state = None

    def on_step(step: int, plan) -> None:
        nonlocal high_state
        high_state = state.get("high", high_state)

    drive(scheduler, worker, streams, on_step=on_step)
    assert high_state is not None and high_state.num_preemptions == 0
    assert streams["high"].finish_reason is FinishReason.LENGTH
    assert scheduler.stats.num_preemptions > 0  # the low ones made room
    assert_exact(streams, [*low, high], geometry)


def test_a_chunk_with_room_in_its_last_block_feeds_that_room_rather_than_preempt():
    """Review finding 11: with the pool empty, a partial prompt whose last block has free
    slots feeds min(chunk, room) and preempts nobody (itself included)."""
    geometry = make_geometry(num_kv_blocks=8, block_size=4)
    scheduler = make_scheduler(geometry, max_num_batched_tokens=26)
    worker = FakeWorker(geometry)
    scheduler.add(make_request("first", 24, max_new_tokens=8, ignore_eos=True), 0.0)
    scheduler.add(make_request("chunked", 30, max_new_tokens=2), 0.0)
    plan = scheduler.schedule(0.0)
    requests = scheduler.core._requests
    # first takes 6 blocks with its 24 tokens; chunked gets 2 tokens: 1 block, 2 slots left.
    assert requests["chunked"].num_computed_tokens == 2
    scheduler.apply(worker.step(plan), 0.5)
    plan = scheduler.schedule(1.0)  # first's decode takes the last free block
    assert scheduler.stats.num_preemptions == 0
    chunked = requests["chunked"]
    assert chunked.seq_id in plan.seq_ids and chunked.num_computed_tokens == 4
    scheduler.apply(worker.step(plan), 1.5)
    check_invariants(scheduler)


def test_without_decode_first_a_continuing_chunk_never_costs_an_older_decoder_its_blocks():
    """sched s3 R4: admission left the decoders' growth blocks alone, a continuing chunk
    did not. r1 decodes at a block boundary while the newer r2 continues its prompt:
    r2's chunk must shrink to the blocks the decodes leave, not make r1 the victim."""
    geometry = make_geometry(num_kv_blocks=7, block_size=4)
    scheduler = make_scheduler(
        geometry, decode_first=False, max_num_batched_tokens=8, prefill_max_tokens=4
    )
    worker = FakeWorker(geometry)
    arrivals = {
        2: make_request("r0", 12, max_new_tokens=6, ignore_eos=True),
        3: make_request("r1", 3, max_new_tokens=12, ignore_eos=True),
        5: make_request("r2", 8, max_new_tokens=6, ignore_eos=True),
    }
    core = scheduler.core
    planner = core._planner
    streams = {}
    for step in range(60):
        if step in arrivals:
            scheduler.add(arrivals[step], float(step))
        admit_orders = {r.request_id: r.admit_order for r in planner.running.values()}
        continuing = {r.seq_id: r.request_id for r in planner.prefilling.values()}
        num_preemptions = planner.num_preemptions
        plan = scheduler.schedule(float(step))
        if plan is None:
            if step > max(arrivals):
                break
            continue
        if planner.num_preemptions > num_preemptions:
            victims = [rid for rid in admit_orders if core._requests[rid].state.name == "WAITING"]
            fed = [rid for seq_id, rid in continuing.items() if seq_id in plan.seq_ids]
            newer_fed = [c for c in fed for v in victims if admit_orders[c] > admit_orders[v]]
            assert not newer_fed, f"step {step}: {victims} preempted while {newer_fed} continued"
        for output in scheduler.apply(worker.step(plan), step + 0.5):
            streams.setdefault(output.request_id, Stream()).take(output)
        check_invariants(scheduler)
    assert_exact(streams, arrivals.values(), geometry)
