"""Overlapped steps, the worker's side: a plan row listed in last_sampled_rows feeds the
token the worker sampled for that sequence last, in place of the plan's placeholder
(protos/step.proto, StepPlan.last_sampled_rows). Torch-free, on the dummy engine, which
shares Engine.step and the sequence table with the paged engine."""

from __future__ import annotations

import pytest

from pagoda.common.dummy_tokens import dummy_next_token
from pagoda.gpu_worker.dummy_engine import DUMMY_VOCAB_SIZE, DummyEngine
from pagoda.gpu_worker.server import WorkerServer
from tests.worker.conftest import run_plan
from tests.worker.test_sequence_table import plan_of

PLACEHOLDER = 0


def ahead(plan, *rows):
    plan.last_sampled_rows.extend(rows)
    return plan


def test_a_placeholder_row_feeds_the_token_sampled_last_as_a_serial_plan_would():
    serial, overlapped = DummyEngine(block_size=4), DummyEngine(block_size=4)
    prompt = plan_of([(1, 0, [10, 11, 12], [0])], new=[(1, [], 3)])
    first = run_plan(serial, prompt).token_ids[0]
    assert run_plan(overlapped, prompt).token_ids[0] == first
    tokens_serial = [first]
    tokens_overlapped = [first]
    for position in range(3, 9):  # across a block boundary: new blocks at 4 and 8
        blocks = [position // 4] if position % 4 == 0 else []
        step = plan_of([(1, position, [tokens_serial[-1]], blocks)], step_id=position)
        tokens_serial.append(run_plan(serial, step).token_ids[0])
        step = ahead(plan_of([(1, position, [PLACEHOLDER], blocks)], step_id=position), 0)
        tokens_overlapped.append(run_plan(overlapped, step).token_ids[0])
    assert tokens_overlapped == tokens_serial
    assert overlapped.table.get(1).token_ids == serial.table.get(1).token_ids
    assert tokens_serial[1] == dummy_next_token(first, 3, DUMMY_VOCAB_SIZE)


def test_only_listed_rows_are_substituted():
    engine = DummyEngine(block_size=4)
    prompts = plan_of([(1, 0, [10, 11], [0]), (2, 0, [20, 21], [1])], new=[(1, [], 2), (2, [], 2)])
    first = run_plan(engine, prompts).token_ids
    step = ahead(plan_of([(1, 2, [PLACEHOLDER], []), (2, 2, [first[1]], [])], step_id=2), 0)
    result = run_plan(engine, step)
    assert list(result.token_ids) == [
        dummy_next_token(first[0], 2, DUMMY_VOCAB_SIZE),
        dummy_next_token(first[1], 2, DUMMY_VOCAB_SIZE),
    ]


@pytest.mark.parametrize(
    ("first_plan", "row", "message"),
    [
        # A prompt chunk that did not sample: there is no token to feed.
        (plan_of([(1, 0, [10, 11], [0], False)], new=[(1, [], 4)]), (1, 2, [0], []), "no token"),
        # The sampled token belongs at position 2, not 3.
        (plan_of([(1, 0, [10, 11], [0])], new=[(1, [], 2)]), (1, 3, [0], []), "belongs at 2"),
        # A placeholder row feeds exactly one token.
        (plan_of([(1, 0, [10, 11], [0])], new=[(1, [], 2)]), (1, 2, [0, 0], []), "1 expected"),
    ],
)
def test_a_row_that_cannot_take_the_last_token_is_refused(first_plan, row, message):
    engine = DummyEngine(block_size=4)
    run_plan(engine, first_plan)
    result = run_plan(engine, ahead(plan_of([row], step_id=2), 0))
    assert [e.seq_id for e in result.errors] == [1] and message in result.errors[0].message
    assert 1 not in engine.table


def test_a_row_index_outside_the_plan_fails_the_step():
    engine = DummyEngine(block_size=4)
    run_plan(engine, plan_of([(1, 0, [10], [0])], new=[(1, [], 1)]))
    result = run_plan(engine, ahead(plan_of([(1, 1, [0], [])], step_id=2), 1))
    assert "last_sampled_rows" in result.step_error


def test_the_hello_announces_the_substitution():
    assert WorkerServer(DummyEngine(), "ipc:///tmp/unused").hello().feeds_last_sampled
