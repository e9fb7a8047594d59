"""The fake worker answers like `--model dummy` and refuses plans a real worker could not run."""

from __future__ import annotations

import pytest

from pagoda.common.dummy_tokens import dummy_next_token
from pagoda.scheduler_svc.core import NewSequence, StepPlan
from pagoda.scheduler_svc.testing import FakeWorker, PlanError
from tests.unit.conftest import make_geometry, make_sampling


def plan(
    step_id: int,
    rows: list[tuple[int, int, list[int], list[int], bool]],
    new: list[int] = (),
    cached: dict | None = None,
    forget: list[int] = (),
) -> StepPlan:
    """rows: (seq_id, start, token_ids, new block_ids, sample)."""
    step_plan = StepPlan(step_id=step_id, forget_seq_ids=list(forget))
    for seq_id in new:
        cached_ids = (cached or {}).get(seq_id, [])
        step_plan.new_sequences.append(
            NewSequence(seq_id, make_sampling(), num_prompt_tokens=4, cached_token_ids=cached_ids)
        )
    for seq_id, start, token_ids, block_ids, sample in rows:
        step_plan.seq_ids.append(seq_id)
        step_plan.start_positions.append(start)
        step_plan.sample.append(sample)
        step_plan.token_ids.extend(token_ids)
        step_plan.token_offsets.append(len(step_plan.token_ids))
        step_plan.block_ids.extend(block_ids)
        step_plan.block_offsets.append(len(step_plan.block_ids))
    return step_plan


def test_it_samples_the_dummy_token_of_the_last_fed_position():
    worker = FakeWorker(make_geometry(block_size=4, vocab_size=50))
    outcome = worker.step(
        plan(1, [(7, 0, [5, 6, 7], [0], True), (8, 0, [9, 9], [1], False)], new=[7, 8])
    )
    assert outcome.seq_ids == [7] and outcome.token_ids == [dummy_next_token(7, 2, 50)]


def test_unknown_and_twice_announced_sequences_are_refused():
    worker = FakeWorker(make_geometry())
    with pytest.raises(PlanError, match="unknown seq 3"):
        worker.step(plan(1, [(3, 0, [1], [0], True)]))
    worker.step(plan(2, [(4, 0, [1], [0], True)], new=[4]))
    with pytest.raises(PlanError, match="new twice"):
        worker.step(plan(3, [(4, 1, [1], [], True)], new=[4]))


def test_positions_must_be_covered_by_blocks_and_fed_in_order():
    worker = FakeWorker(make_geometry(block_size=4))
    with pytest.raises(PlanError, match="do not cover position 4"):
        worker.step(plan(1, [(1, 0, [1, 2, 3, 4, 5], [0], True)], new=[1]))
    worker = FakeWorker(make_geometry(block_size=4))
    worker.step(plan(1, [(1, 0, [1, 2], [0], True)], new=[1]))
    with pytest.raises(PlanError, match="feeds from position 3 but has K/V up to 2"):
        worker.step(plan(2, [(1, 3, [1], [], True)]))


def test_sharing_a_block_with_other_content_is_caught():
    worker = FakeWorker(make_geometry(block_size=2))
    worker.step(plan(1, [(1, 0, [1, 2, 3], [0, 1], True)], new=[1]))
    # Seq 2 claims block 0 holds its prefix [1, 9]: it holds [1, 2].
    with pytest.raises(PlanError, match="cached position 1 holds other K/V"):
        worker.step(plan(2, [(2, 2, [5], [0, 2], True)], new=[2], cached={2: [1, 9]}))


def test_overwriting_a_block_another_live_sequence_reads_is_caught():
    worker = FakeWorker(make_geometry(block_size=2))
    worker.step(plan(1, [(1, 0, [1, 2, 3], [0, 1], True)], new=[1]))
    with pytest.raises(PlanError, match="overwrites block 0"):
        worker.step(plan(2, [(2, 0, [7, 8], [0], True)], new=[2]))
    # Reusing a block in the plan that forgets its last reader is fine.
    worker = FakeWorker(make_geometry(block_size=2))
    worker.step(plan(1, [(1, 0, [1, 2, 3], [0, 1], True)], new=[1]))
    worker.step(plan(2, [(2, 0, [7, 8], [0], True)], new=[2], forget=[1]))
    assert worker.live_seq_ids == {2}


def test_malformed_columns_are_caught():
    malformed = plan(1, [(1, 0, [1], [0], True)], new=[1])
    malformed.token_offsets.append(5)
    with pytest.raises(PlanError, match="token_offsets"):
        FakeWorker(make_geometry()).step(malformed)
    with pytest.raises(PlanError, match="outside the pool"):
        FakeWorker(make_geometry(num_kv_blocks=2)).step(plan(1, [(1, 0, [1], [2], True)], new=[1]))


def test_a_failed_step_forgets_everything_it_named():
    worker = FakeWorker(make_geometry())
    worker.step(plan(1, [(1, 0, [1], [0], True)], new=[1]))
    outcome = worker.fail(plan(2, [(1, 1, [4], [], True), (2, 0, [1], [1], True)], new=[2]))
    assert outcome.step_error and worker.live_seq_ids == set()


@pytest.mark.parametrize("overlapped", [False, True])
def test_the_step_after_a_refusal_may_feed_the_refused_only_when_overlapped(overlapped):
    """An overlapped scheduler plans N+1 before N's refusal is known: a real worker then
    refuses the forgotten sequence again. The step after that one may not feed it."""
    worker = FakeWorker(make_geometry(block_size=4), overlapped=overlapped)
    worker.step(plan(1, [(1, 0, [5, 6], [0], True)], new=[1]), refuse={1})
    if not overlapped:
        with pytest.raises(PlanError, match="unknown seq 1"):
            worker.step(plan(2, [(1, 2, [7], [], True)]))
        return
    again = worker.step(plan(2, [(1, 2, [7], [], True)]))
    assert 1 in again.errors and again.seq_ids == []
    with pytest.raises(PlanError, match="unknown seq 1"):
        worker.step(plan(3, [(1, 2, [7], [], True)]))
