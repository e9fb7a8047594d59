"""n > 1: one request's samples are n core requests sharing the prompt's KV blocks, the
prompt computed once (issue 28 item 4)."""

from __future__ import annotations

import dataclasses

import pytest

from pagoda.scheduler_svc.core import FinishReason
from pagoda.scheduler_svc.core.request import sample_request_ids
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import (
    drive,
    expected_generation,
    make_geometry,
    make_request,
    make_scheduler,
)

BLOCK_SIZE = 4


def samples_of(request_id: str = "r0", n: int = 4, prompt: int = 10, **fields):
    request = make_request(request_id, prompt, **fields)
    return dataclasses.replace(request, n=n)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("max_num_batched_tokens", [64, 3])
def test_the_prompt_is_computed_once_and_its_full_blocks_shared(
    prefix_caching, max_num_batched_tokens
):
    geometry = make_geometry(block_size=BLOCK_SIZE)
    scheduler = make_scheduler(
        geometry, prefix_caching=prefix_caching, max_num_batched_tokens=max_num_batched_tokens
    )
    request = samples_of(n=4, prompt=10, max_new_tokens=6)
    scheduler.add(request, 0.0)
    plans = []
    streams = drive(scheduler, FakeWorker(geometry), on_step=lambda _, plan: plans.append(plan))
    expected, reason, text = expected_generation(request, geometry)
    assert sorted(streams) == sample_request_ids("r0", 4) == ["r0#0", "r0#1", "r0#2", "r0#3"]
    for stream in streams.values():
        assert (stream.token_ids, stream.finish_reason, stream.text) == (expected, reason, text)
    # The prompt once (10 tokens), then each sibling its last partial block (2 tokens):
    # at most block_size - 1 each.
    num_prompt_fed = sum(
        plan.token_offsets[i + 1] - plan.token_offsets[i]
        for plan in plans
        for i, start in enumerate(plan.start_positions)
        if start < 10
    )
    assert num_prompt_fed == 10 + 3 * 2
    assert num_prompt_fed <= 10 + 3 * (BLOCK_SIZE - 1)
    # Siblings are new sequences whose cached tokens are the prompt's two full blocks.
    news = [new for plan in plans for new in plan.new_sequences]
    assert sorted(len(new.cached_token_ids) for new in news) == [0, 8, 8, 8]
    assert {stream.usage.cached_prompt_tokens for stream in streams.values()} == {0, 8}
    # Every block is back: no owner left.
    allocator = scheduler.core._planner.blocks.allocator
    assert allocator.num_used_blocks == 0
    assert all(allocator.ref_count(b) == 0 for b in range(allocator.num_total_blocks))


def test_siblings_share_blocks_by_reference_count_while_running():
    geometry = make_geometry(block_size=BLOCK_SIZE)
    scheduler = make_scheduler(geometry, prefix_caching=False)
    scheduler.add(samples_of(n=3, prompt=10, max_new_tokens=20), 0.0)
    worker = FakeWorker(geometry)
    drive(scheduler, worker, max_steps=4, stop_early=True)
    running = list(scheduler.core._planner.running.values())
    assert len(running) == 3
    shared = running[0].block_ids[:2]
    assert all(request.block_ids[:2] == shared for request in running)
    allocator = scheduler.core._planner.blocks.allocator
    assert [allocator.ref_count(block_id) for block_id in shared] == [3, 3]
    # Their own last blocks are their own.
    assert len({request.block_ids[2] for request in running}) == 3


def test_seeds_are_seed_plus_index():
    geometry = make_geometry(block_size=BLOCK_SIZE)
    scheduler = make_scheduler(geometry)
    request = samples_of(n=3)
    request = dataclasses.replace(
        request, sampling=dataclasses.replace(request.sampling, seed=2**64 - 2)
    )
    scheduler.add(request, 0.0)
    plans = []
    drive(scheduler, FakeWorker(geometry), on_step=lambda _, plan: plans.append(plan))
    seeds = [new.sampling.seed for plan in plans for new in plan.new_sequences]
    assert sorted(seeds) == [0, 2**64 - 2, 2**64 - 1]


@pytest.mark.parametrize("num_steps", [0, 1, 3])
def test_cancelling_every_sample_frees_everything(num_steps):
    geometry = make_geometry(block_size=BLOCK_SIZE)
    scheduler = make_scheduler(geometry, prefix_caching=False, max_num_batched_tokens=4)
    scheduler.add(samples_of(n=4, prompt=10, max_new_tokens=50), 0.0)
    worker = FakeWorker(geometry)
    if num_steps:
        drive(scheduler, worker, max_steps=num_steps, stop_early=True)
    outputs = [scheduler.cancel(request_id, 9.0) for request_id in sample_request_ids("r0", 4)]
    assert [output.finish_reason for output in outputs] == [FinishReason.CANCELLED] * 4
    assert not scheduler.has_work() and not scheduler.core._requests
    assert scheduler.core._planner.blocks.allocator.num_used_blocks == 0
    assert scheduler.schedule(10.0) is None or not scheduler.has_work()


def test_a_preempted_sample_recomputes_without_losing_the_others():
    # 6 blocks of 4: four samples of a 10-token prompt growing to 22 tokens cannot all fit.
    geometry = make_geometry(num_kv_blocks=9, block_size=BLOCK_SIZE)
    scheduler = make_scheduler(geometry, prefix_caching=False)
    request = samples_of(n=4, prompt=10, max_new_tokens=12, ignore_eos=True)
    scheduler.add(request, 0.0)
    streams = drive(scheduler, FakeWorker(geometry))
    assert scheduler.core.stats.num_preemptions > 0
    expected, reason, text = expected_generation(request, geometry)
    for stream in streams.values():
        assert (stream.token_ids, stream.finish_reason, stream.text) == (expected, reason, text)
        assert stream.num_events_after_finish == 0
    assert scheduler.core._planner.blocks.allocator.num_used_blocks == 0


def test_a_duplicate_sample_id_refuses_the_whole_request():
    scheduler = make_scheduler()
    scheduler.add(make_request("r0#2"), 0.0)
    with pytest.raises(ValueError, match="r0#2"):
        scheduler.core.add(samples_of("r0", n=3), 0.0)
    assert list(scheduler.core._requests) == ["r0#2"]


def test_n_of_one_is_one_request_under_its_own_id():
    scheduler = make_scheduler()
    scheduler.add(samples_of("r0", n=1), 0.0)
    assert list(scheduler.core._requests) == ["r0"]
    assert not scheduler.core._requests["r0"].shares_prompt
