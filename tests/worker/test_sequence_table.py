"""Plan admission (torch-free): block deltas, history, refusals, malformed columns.
Exercised through the dummy engine too, which shares the table."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from pagoda.common.dummy_tokens import dummy_next_token
from pagoda.common.plan_check import PlanError
from pagoda.common.step_codec import decode_plan
from pagoda.gpu_worker.dummy_engine import DUMMY_VOCAB_SIZE, DummyEngine
from pagoda.gpu_worker.sequence_table import SequenceTable, allowed_token_masks
from pagoda.protos import step_pb2
from tests.worker.conftest import run_plan


def make_table(**overrides) -> SequenceTable:
    settings = dict(
        num_kv_blocks=8, block_size=4, vocab_size=100, max_context_tokens=64, max_logprobs=20
    )
    settings.update(overrides)
    return SequenceTable(**settings)


def admit(table: SequenceTable, plan: step_pb2.StepPlan):
    """The table admits the plan as the server decodes it: (the rows to run, refusals)."""
    return table.admit(decode_plan(plan))


def plan_of(entries, new=(), forget=(), step_id=1) -> step_pb2.StepPlan:
    """entries: (seq_id, start, tokens, new_block_ids[, sample])."""
    plan = step_pb2.StepPlan(step_id=step_id, forget_seq_ids=list(forget))
    for seq_id, cached, num_prompt in new:
        plan.new_sequences.add(seq_id=seq_id, cached_token_ids=cached, num_prompt_tokens=num_prompt)
    if entries:
        plan.token_offsets.append(0)
        plan.block_offsets.append(0)
    for seq_id, start, tokens, blocks, *sample in entries:
        plan.seq_ids.append(seq_id)
        plan.start_positions.append(start)
        plan.sample.append(sample[0] if sample else True)
        plan.token_ids.extend(tokens)
        plan.token_offsets.append(len(plan.token_ids))
        plan.block_ids.extend(blocks)
        plan.block_offsets.append(len(plan.block_ids))
    return plan


def test_block_tables_grow_from_deltas_and_history_follows_positions():
    table = make_table()
    admit(table, plan_of([(1, 0, [10, 11, 12, 13, 14], [5, 2])], new=[(1, [], 5)]))
    admit(table, plan_of([(1, 5, [15], [])]))
    seq = table.get(1)
    assert seq.block_ids == [5, 2]
    assert seq.token_ids == [10, 11, 12, 13, 14, 15]
    # A rewound start (recompute of the tail) truncates, then extends.
    admit(table, plan_of([(1, 3, [20, 21, 22, 23, 24], [7])]))
    assert seq.token_ids == [10, 11, 12, 20, 21, 22, 23, 24]
    assert seq.block_ids == [5, 2, 7]


def test_cached_prefix_tokens_count_as_known_history():
    table = make_table()
    admitted, _ = admit(table, plan_of([(1, 4, [4, 5], [0, 1])], new=[(1, [0, 1, 2, 3], 6)]))
    assert admitted.start_positions[0] + admitted.token_offsets[1] == 6  # its end position
    assert table.get(1).token_ids == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("entry", "new", "message"),
    [
        ((9, 0, [1], [0]), [], "unknown sequence 9"),
        ((1, 0, [1], [8]), [(1, [], 1)], "block id 8 out of range"),
        ((1, 0, [1, 2, 3, 4, 5], [0]), [(1, [], 5)], "not covered"),
        ((1, 2, [1], [0]), [(1, [], 3)], "only 0 earlier tokens"),
        ((1, 0, [], [0]), [(1, [], 0)], "feeds no tokens"),
        ((1, 0, [100], [0]), [(1, [], 1)], "token id 100 out of range"),
        ((1, 62, [1, 2, 3], [0]), [(1, list(range(62)), 65)], "exceed the context"),
    ],
)
def test_bad_entry_is_refused_and_the_sequence_forgotten(entry, new, message):
    table = make_table()
    admit(table, plan_of([(5, 0, [1, 2], [3])], new=[(5, [], 2)]))
    admitted, refusals = admit(table, plan_of([entry, (5, 2, [3], [])], new=new))
    assert list(refusals) == [entry[0]]
    assert message in refusals[entry[0]]
    assert entry[0] not in table
    assert admitted.seq_ids == [5]


def test_a_new_sequence_with_a_live_id_replaces_it():
    table = make_table()
    admit(table, plan_of([(1, 0, [1, 2, 3], [0])], new=[(1, [], 3)]))
    admit(table, plan_of([(1, 0, [7], [4])], new=[(1, [], 1)]))
    assert table.get(1).block_ids == [4]
    assert table.get(1).token_ids == [7]


def test_duplicate_entries_are_refused():
    table = make_table()
    admitted, refusals = admit(
        table, plan_of([(1, 0, [1], [0]), (1, 1, [2], [])], new=[(1, [], 1)])
    )
    assert list(refusals) == [1]
    assert admitted.seq_ids == []


def test_an_all_valid_plan_is_admitted_as_itself():
    """The common step (every row valid, no placeholder) runs the decoded plan's own
    columns: nothing is copied or converted per row."""
    table = make_table()
    plan = decode_plan(
        plan_of([(1, 0, [1, 2], [0]), (2, 0, [3], [1])], new=[(1, [], 2), (2, [], 1)])
    )
    admitted, refusals = table.admit(plan)
    assert admitted is plan and refusals == {}


def test_refused_rows_are_dropped_from_the_admitted_columns():
    """Rows of refused sequences leave every column; the rest keep their tokens, blocks
    and bitmasks, renumbered; the caller's plan is left as it was."""
    table = make_table()
    admit(table, plan_of([(3, 0, [5], [4])], new=[(3, [], 1)]))
    wire = plan_of(
        [(1, 0, [10, 11], [0]), (9, 0, [1], [1]), (3, 1, [12], []), (2, 0, [13, 14, 15], [2, 3])],
        new=[(1, [], 2), (2, [], 3)],
    )
    wire.allowed_token_rows[:] = [0, 1, 2]
    wire.allowed_token_bitmask = bytes([1] * 16 + [2] * 16 + [3] * 16)
    plan = decode_plan(wire)
    before = dataclasses.replace(plan)
    admitted, refusals = table.admit(plan)
    assert list(refusals) == [9]
    assert admitted.seq_ids == [1, 3, 2]
    assert admitted.start_positions == [0, 1, 0]
    assert admitted.token_offsets == [0, 2, 3, 6]
    assert admitted.token_ids == [10, 11, 12, 13, 14, 15]
    assert admitted.block_offsets == [0, 1, 1, 3]
    assert admitted.block_ids == [0, 2, 3]
    assert admitted.allowed_token_rows == [0, 1]
    assert admitted.allowed_token_bitmask == bytes([1] * 16 + [3] * 16)
    assert allowed_token_masks(admitted, 100) == {0: [bytes([1] * 16)], 1: [bytes([3] * 16)]}
    assert plan == before


def test_placeholders_are_filled_into_the_admitted_token_ids():
    table = make_table()
    admitted, _ = admit(
        table, plan_of([(1, 0, [10, 11], [0]), (2, 0, [12], [1])], new=[(1, [], 2), (2, [], 1)])
    )
    table.record_sampled(table.sampling_rows(admitted), [42, 43])
    wire = plan_of([(1, 2, [0], []), (2, 1, [0], [])])
    wire.last_sampled_rows.append(1)
    plan = decode_plan(wire)
    admitted, refusals = table.admit(plan)
    assert refusals == {} and admitted.token_ids == [0, 43] and admitted.last_sampled_rows == []
    assert plan.token_ids == [0, 0] and plan.last_sampled_rows == [1]  # the caller's, as sent
    assert table.get(2).token_ids == [12, 43]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p.start_positions.append(0),
        lambda p: p.token_offsets.append(3),
        lambda p: p.block_offsets.__setitem__(0, 1),
        lambda p: p.sample.pop(),
    ],
)
def test_misaligned_columns_are_a_plan_error(mutate):
    plan = plan_of([(1, 0, [1, 2], [0])], new=[(1, [], 2)])
    mutate(plan)
    with pytest.raises(PlanError):
        admit(make_table(), plan)


def test_dummy_engine_answers_dummy_next_token_and_refuses_like_the_paged_one():
    engine = DummyEngine(block_size=4, num_kv_blocks=16)
    plan = plan_of(
        [(1, 0, [10, 11, 12], [0]), (2, 0, [5, 6], [99]), (3, 0, [4, 4], [1], False)],
        new=[(1, [], 3), (2, [], 2), (3, [], 4)],
    )
    result = run_plan(engine, plan)
    assert list(result.seq_ids) == [1]
    assert list(result.token_ids) == [dummy_next_token(12, 2, DUMMY_VOCAB_SIZE)]
    assert [e.seq_id for e in result.errors] == [2]
    decode = run_plan(engine, plan_of([(1, 3, [result.token_ids[0]], []), (3, 2, [8, 9], [])]))
    assert list(decode.token_ids) == [
        dummy_next_token(result.token_ids[0], 3, DUMMY_VOCAB_SIZE),
        dummy_next_token(9, 3, DUMMY_VOCAB_SIZE),
    ]


def test_dummy_engine_fault_injection_and_malformed_plans_become_step_errors():
    engine = DummyEngine(fail_on_token_id=13)
    run_plan(engine, plan_of([(1, 0, [1], [0])], new=[(1, [], 1)]))
    failed = run_plan(engine, plan_of([(1, 1, [13], [])]))
    assert "13" in failed.step_error and 1 not in engine.table
    malformed = plan_of([(2, 0, [1], [0])], new=[(2, [], 1)])
    malformed.start_positions.append(5)
    assert "start_positions" in run_plan(engine, malformed).step_error


def test_dummy_worker_modules_do_not_import_torch():
    code = (
        "import sys, pagoda.gpu_worker.__main__, pagoda.gpu_worker.dummy_engine, pagoda.gpu_worker.server; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
