"""Structured output on the scheduler (issue 28 item 3): constraints compile or are refused
by name; each step's bitmasks cover exactly the constrained rows that sample, with the
matcher fed the request's generated tokens first; the masks travel in the plan and reach
the worker's chunks row for row; a constrained request is never planned ahead."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from pagoda.common import step_codec, wire
from pagoda.common.plan_check import PlanError
from pagoda.common.step import mask_words
from pagoda.common.step_codec import decode_plan
from pagoda.gpu_worker.sequence_table import SequenceTable, allowed_token_masks
from pagoda.protos import generation_pb2 as pb
from pagoda.scheduler_svc import grammar_masks, grammars
from pagoda.scheduler_svc.constraint_validation import validate_constraint
from pagoda.scheduler_svc.core import NewSequence, StepPlan
from pagoda.scheduler_svc.core.request import Request, token_array
from pagoda.scheduler_svc.grammar_masks import fill_masks, masks_after
from pagoda.scheduler_svc.grammars import GrammarError, ValidConstraint
from pagoda.scheduler_svc.validation import ValidationError
from tests.conftest import TINY_VOCAB_SIZE
from tests.unit.conftest import make_geometry, make_request, make_scheduler

EOS = 2


@pytest.fixture(scope="module")
def vocabulary(tiny_llg_tokenizer):
    return [tiny_llg_tokenizer.decode_bytes([t]) for t in range(TINY_VOCAB_SIZE)]


def allowed_ids(bitmask: bytes) -> set[int]:
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")
    return {int(t) for t in np.flatnonzero(bits)}


def running(request_id: str, grammar, generated: list[int] = ()) -> Request:
    prompt = [5, 6, 7]
    return Request(
        request_id=request_id,
        sampling=None,
        stopping=None,
        priority=0,
        num_prompt_tokens=len(prompt),
        token_ids=token_array([*prompt, *generated]),
        arrival_s=0.0,
        grammar=grammar,
    )


def plan_of(seq_ids: list[int], sample: list[bool]) -> StepPlan:
    return StepPlan(step_id=1, seq_ids=seq_ids, sample=sample)


def test_masks_cover_the_constrained_sampling_rows_only(compiler, vocabulary):
    regex = compiler.compile(ValidConstraint("regex", "a+b"), TINY_VOCAB_SIZE, [EOS])
    other = compiler.compile(ValidConstraint("regex", "a+b"), TINY_VOCAB_SIZE, [EOS])
    requests = {
        1: running("free", None),
        2: running("constrained", regex),
        3: running("prefilling", other),  # does not sample this step: no mask
    }
    plan = plan_of([1, 2, 3], [True, True, False])
    fill_masks(plan, requests.get, TINY_VOCAB_SIZE)
    assert plan.allowed_token_rows == [1]
    assert len(plan.allowed_token_bitmask) == mask_words(TINY_VOCAB_SIZE) * 4
    allowed = allowed_ids(plan.allowed_token_bitmask)
    assert allowed and all(set(vocabulary[t].decode()) <= {"a", "b"} for t in allowed)
    assert EOS not in allowed  # "a+b" is not matched by nothing


def test_masks_are_the_same_on_the_loops_thread_and_on_llguidances(
    compiler, vocabulary, monkeypatch
):
    """Rows without drafts are computed on the step loop's thread where the scheduler has
    few CPUs: the same bits as the threads give, row for row, with an error row's EOS."""
    a = vocabulary.index(b"a")
    constraints = [("regex", "a+b"), ("choice", '["ab", "ba"]'), ("json_object", "")]
    requests = {}
    for seq_id, (kind, source) in enumerate(constraints * 2, start=1):
        grammar = compiler.compile(ValidConstraint(kind, source), TINY_VOCAB_SIZE, [EOS])
        requests[seq_id] = running(f"r{seq_id}", grammar, [a] if seq_id > 3 else [])
    masks = {}
    for threads in (0, 2):
        monkeypatch.setattr(grammar_masks, "_num_mask_threads", threads)
        for request in requests.values():  # each computes from the same state again
            request.grammar.matcher.reset()
            request.grammar.num_consumed_tokens = 0
        plan = plan_of(list(requests), [True] * len(requests))
        fill_masks(plan, requests.get, TINY_VOCAB_SIZE)
        masks[threads] = plan.allowed_token_bitmask
    assert masks[0] == masks[2]
    words = np.frombuffer(masks[0], dtype="<u4").reshape(len(requests), -1)
    assert words.any(axis=1).all()


def test_drafted_masks_are_the_same_on_the_loops_thread_and_on_llguidances(
    compiler, vocabulary, monkeypatch
):
    """Drafted rows too: right drafts, a refused one, EOS as a draft; each matcher rolled
    back to where it was."""
    a, b = vocabulary.index(b"a"), vocabulary.index(b"b")
    rows = [  # (constraint, tokens fed before, the row's last token and drafts)
        (("choice", '["ababa"]'), [a], [a, b, a, b]),
        (("choice", '["ababa"]'), [a], [a, a, b]),  # the first draft is refused
        (("choice", '["ab"]'), [], [b, a, b, EOS]),  # EOS ends it, then nothing fits
        (("regex", "a+b"), [a, a], [a, a, a, b, EOS]),
        (("json_object", ""), [], [b]),  # no drafts
    ]
    masks, consumed = {}, {}
    for threads in (0, 2):
        monkeypatch.setattr(grammar_masks, "_num_mask_threads", threads)
        requests, token_ids, offsets, counts = {}, [], [0], []
        for seq_id, ((kind, source), fed, tokens) in enumerate(rows, start=1):
            grammar = compiler.compile(ValidConstraint(kind, source), TINY_VOCAB_SIZE, [EOS])
            requests[seq_id] = running(f"r{seq_id}", grammar, fed)
            token_ids += tokens
            offsets.append(len(token_ids))
            counts.append(len(tokens) - 1)
        plan = StepPlan(
            step_id=1, seq_ids=list(requests), sample=[True] * len(rows),
            token_offsets=offsets, token_ids=token_ids, draft_counts=counts,
        )  # fmt: skip
        fill_masks(plan, requests.get, TINY_VOCAB_SIZE)
        masks[threads] = plan.allowed_token_bitmask
        consumed[threads] = [
            r.grammar.matcher.validate_tokens([a, b, a]) for r in requests.values()
        ]
    assert masks[0] == masks[2]
    assert consumed[0] == consumed[2]  # the same matcher states after the roll-backs


@pytest.mark.parametrize(("cpus", "threads"), [(1, 0), (2, 0), (4, 2), (16, 2)])
def test_mask_threads_are_used_where_cpus_are_to_spare(monkeypatch, cpus, threads):
    monkeypatch.setattr(grammar_masks.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert grammar_masks.mask_threads() == threads


def test_the_matcher_catches_up_with_generated_tokens_and_ends_with_eos(compiler, vocabulary):
    grammar = compiler.compile(ValidConstraint("choice", '["ab"]'), TINY_VOCAB_SIZE, [EOS])
    a, b = vocabulary.index(b"a"), vocabulary.index(b"b")
    request = running("r", grammar, [a])
    plan = plan_of([1], [True])
    fill_masks(plan, {1: request}.get, TINY_VOCAB_SIZE)
    assert allowed_ids(plan.allowed_token_bitmask) == {b}
    request.token_ids.append(b)
    fill_masks(plan, {1: request}.get, TINY_VOCAB_SIZE)
    assert allowed_ids(plan.allowed_token_bitmask) == {EOS}  # complete: only EOS
    assert grammar.num_consumed_tokens == 2


def drafted_plan(token_ids: list[int], num_drafts: int) -> StepPlan:
    """Sequence 1's decode row: its last token, then `num_drafts` drafts."""
    return StepPlan(
        step_id=1, seq_ids=[1], sample=[True], token_offsets=[0, len(token_ids)],
        token_ids=token_ids, draft_counts=[num_drafts],
    )  # fmt: skip


def test_a_row_with_drafts_gets_the_mask_after_each_and_its_matcher_is_rolled_back(
    compiler, vocabulary
):
    grammar = compiler.compile(ValidConstraint("choice", '["ababa"]'), TINY_VOCAB_SIZE, [EOS])
    a, b = vocabulary.index(b"a"), vocabulary.index(b"b")
    request = running("r", grammar, [a])
    words = mask_words(TINY_VOCAB_SIZE) * 4

    def masks_of(plan: StepPlan) -> list[set[int]]:
        fill_masks(plan, {1: request}.get, TINY_VOCAB_SIZE)
        assert plan.allowed_token_rows == [0]
        bitmask = plan.allowed_token_bitmask
        return [allowed_ids(bitmask[k : k + words]) for k in range(0, len(bitmask), words)]

    # Right drafts: the mask after each is the grammar's after it.
    assert masks_of(drafted_plan([a, b, a, b], 3)) == [{b}, {a}, {b}, {a}]
    # A draft the grammar refuses: the points after it allow EOS only (never kept).
    assert masks_of(drafted_plan([a, a, b], 2)) == [{b}, {EOS}, {EOS}]
    # The matcher fed nothing for good: the next plain row's mask is the first one's.
    assert grammar.num_consumed_tokens == 1
    assert masks_of(drafted_plan([a], 0)) == [{b}]
    # Kept drafts are fed once the core appends them (catch_up).
    request.token_ids.extend([b, a, b, a])
    assert masks_of(drafted_plan([a, EOS], 1)) == [{EOS}, {EOS}]
    assert grammar.num_consumed_tokens == 5


def test_the_core_asks_how_many_drafts_the_grammar_allows(compiler, vocabulary):
    grammar = compiler.compile(ValidConstraint("choice", '["ababa"]'), TINY_VOCAB_SIZE, [EOS])
    a, b = vocabulary.index(b"a"), vocabulary.index(b"b")
    request = running("r", grammar, [a])
    assert grammar.num_allowed(request, [b, a, a, b]) == 2  # after "aba", "a" is refused
    assert grammar.num_allowed(request, [a]) == 0
    assert grammar.num_consumed_tokens == 1  # caught up, nothing more consumed
    plan = plan_of([1], [True])
    fill_masks(plan, {1: request}.get, TINY_VOCAB_SIZE)
    assert allowed_ids(plan.allowed_token_bitmask) == {b}


def test_the_core_drafts_the_tokens_the_grammar_forces(compiler, tiny_llg_tokenizer):
    """A JSON key, a choice's only way on: llguidance's fast-forward tokens, after the
    request's tokens, nothing consumed; none where the model has a choice."""
    choice = ValidConstraint("choice", '["The quick brown fox", "The lazy dog"]')
    grammar = compiler.compile(choice, TINY_VOCAB_SIZE, [EOS])
    request = running("r", grammar)
    assert tiny_llg_tokenizer.decode_str(grammar.forced_tokens(request)).startswith("The")
    request.token_ids.extend(tiny_llg_tokenizer.tokenize_str("The q"))
    forced = tiny_llg_tokenizer.decode_str(grammar.forced_tokens(request))
    assert forced and "The q" + forced in "The quick brown fox"
    assert grammar.num_consumed_tokens == len(tiny_llg_tokenizer.tokenize_str("The q"))
    open_string = compiler.compile(ValidConstraint("regex", "[a-z]+"), TINY_VOCAB_SIZE, [EOS])
    assert open_string.forced_tokens(running("s", open_string)) == []


def test_a_constraint_compiled_again_is_a_copy_of_the_first(compiler, vocabulary, monkeypatch):
    constraint = ValidConstraint("choice", '["ab", "ba"]')
    first = compiler.compile(constraint, TINY_VOCAB_SIZE, [EOS])
    texts = []
    monkeypatch.setattr(grammars, "_grammar_text", lambda c: texts.append(c) or "")
    second = compiler.compile(constraint, TINY_VOCAB_SIZE, [EOS])
    assert texts == [] and second.matcher is not first.matcher  # not compiled again
    a, b = vocabulary.index(b"a"), vocabulary.index(b"b")
    first_request, second_request = running("one", first, [a]), running("two", second, [b])
    plan = plan_of([1, 2], [True, True])
    fill_masks(plan, {1: first_request, 2: second_request}.get, TINY_VOCAB_SIZE)
    words = mask_words(TINY_VOCAB_SIZE) * 4
    masks = plan.allowed_token_bitmask
    assert allowed_ids(masks[:words]) == {b} and allowed_ids(masks[words:]) == {a}


def test_nothing_is_filled_without_a_live_grammar():
    assert not grammars.any_live()
    plan = plan_of([1], [True])
    fill_masks(plan, lambda seq_id: None, TINY_VOCAB_SIZE)
    assert plan.allowed_token_rows == [] and plan.allowed_token_bitmask == b""


@pytest.mark.parametrize(
    ("constraint", "phrase"),
    [
        (ValidConstraint("json_schema", "{oops"), "constraint.json_schema is invalid"),
        (ValidConstraint("json_schema", '{"type": "nope"}'), "constraint.json_schema is invalid"),
        (ValidConstraint("json_schema", "[1]"), "must be a JSON object"),
        (ValidConstraint("regex", "a(b"), "constraint.regex is invalid"),
        (ValidConstraint("lark_grammar", "start: nowhere"), "constraint.lark_grammar is invalid"),
        (ValidConstraint("gbnf_grammar", "root ::= ("), "constraint.gbnf_grammar is invalid"),
    ],
)
def test_invalid_constraints_are_refused_by_name(compiler, constraint, phrase):
    with pytest.raises(GrammarError) as refused:
        compiler.compile(constraint, TINY_VOCAB_SIZE, [EOS])
    assert phrase in str(refused.value)


def constrained(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(constraint=pb.Constraint(**fields))


@pytest.mark.parametrize(
    ("message", "stopping", "phrase"),
    [
        (constrained(regex="a"), {"ignore_eos": True}, "ignore_eos"),
        (constrained(regex="a"), {"min_new_tokens": 2}, "min_new_tokens"),
        (constrained(regex=""), {}, "constraint.regex must not be empty"),
        (constrained(choice=pb.Choices()), {}, "constraint.choice must hold 1 to 256"),
        (constrained(choice=pb.Choices(choices=["a", ""])), {}, "empty string"),
        (constrained(json_schema="x" * 70000), {}, "at most 65536"),
    ],
)
def test_constraints_are_checked_against_the_request(message, stopping, phrase):
    valid = make_request(**stopping)
    with pytest.raises(ValidationError) as refused:
        validate_constraint(message, valid)
    assert phrase in str(refused.value)


def test_a_request_without_a_constraint_has_none():
    assert validate_constraint(pb.GenerateRequest(), make_request()) is None
    assert validate_constraint(constrained(json_object=False), make_request()) is None
    assert validate_constraint(
        constrained(choice=pb.Choices(choices=["x", "y"])), make_request()
    ) == (ValidConstraint("choice", json.dumps(["x", "y"])))


def test_the_mask_columns_reach_the_worker_row_for_row():
    vocab_size = 100  # 4 words a row
    plan = StepPlan(
        step_id=3,
        seq_ids=[10, 11, 12],
        start_positions=[0, 0, 0],
        sample=[True, True, True],
        token_offsets=[0, 1, 2, 3],
        token_ids=[4, 5, 6],
        block_offsets=[0, 1, 2, 3],
        block_ids=[0, 1, 2],
        allowed_token_rows=[0, 2],
        allowed_token_bitmask=bytes(range(16)) + bytes(range(100, 116)),
    )
    plan.new_sequences = [new_sequence(seq_id) for seq_id in plan.seq_ids]
    decoded = decode_plan(step_codec.encode_plan(plan))
    assert decoded.allowed_token_rows == [0, 2]
    table = SequenceTable(
        num_kv_blocks=8, block_size=4, vocab_size=vocab_size, max_context_tokens=64, max_logprobs=5
    )
    admitted, _ = table.admit(decoded)
    masks = allowed_token_masks(admitted, vocab_size)
    assert [masks.get(row) for row in range(len(admitted.seq_ids))] == [
        [bytes(range(16))],
        None,
        [bytes(range(100, 116))],
    ]
    for bad in (
        dataclasses.replace(decoded, allowed_token_bitmask=b"\0" * 12),  # short
        dataclasses.replace(decoded, allowed_token_rows=[2, 0]),  # not ascending
        dataclasses.replace(decoded, allowed_token_rows=[0, 3]),  # no such row
        dataclasses.replace(decoded, allowed_token_rows=[0, 1], sample=[True, False, True]),
    ):
        table = SequenceTable(
            num_kv_blocks=8, block_size=4, vocab_size=vocab_size, max_context_tokens=64,
            max_logprobs=5,
        )  # fmt: skip
        with pytest.raises(PlanError):
            table.admit(bad)


def new_sequence(seq_id: int) -> NewSequence:
    return NewSequence(
        seq_id=seq_id,
        sampling=make_request().sampling,
        cached_token_ids=[],
        num_prompt_tokens=1,
    )


def test_a_constrained_request_is_planned_ahead_like_any_other():
    scheduler = make_scheduler(make_geometry(block_size=4))
    scheduler.add(make_request("free", 6, max_new_tokens=8), 0.0)
    scheduler.add(
        dataclasses.replace(make_request("json", 6, max_new_tokens=8), grammar=object()), 0.0
    )
    first = scheduler.schedule(0.0)
    assert len(first.seq_ids) == 2 and all(first.sample)
    second = scheduler.schedule(0.0, ahead=True)
    assert len(second.seq_ids) == 2 and second.last_sampled_rows == [0, 1]


def test_an_ahead_row_s_mask_follows_the_plan_once_its_token_is_known(compiler, vocabulary):
    a, b = vocabulary.index(b"a"), vocabulary.index(b"b")
    ahead = running(
        "ahead", compiler.compile(ValidConstraint("choice", '["ab"]'), TINY_VOCAB_SIZE, [EOS])
    )
    known = running(
        "known", compiler.compile(ValidConstraint("regex", "a+b"), TINY_VOCAB_SIZE, [EOS])
    )
    ended = running(
        "ended", compiler.compile(ValidConstraint("regex", "a+b"), TINY_VOCAB_SIZE, [EOS])
    )
    requests = {1: ahead, 2: known, 3: ended}
    plan = StepPlan(step_id=7, seq_ids=[1, 2, 3], sample=[True] * 3, last_sampled_rows=[0, 2])
    pending = fill_masks(plan, requests.get, TINY_VOCAB_SIZE)
    # The known row's mask is in the plan; the rows planned ahead wait for their token.
    assert plan.masks_follow and plan.allowed_token_rows == [1]
    assert [seq_id for seq_id, _ in pending.rows] == [1, 3] and pending.step_id == 7
    assert ahead.grammar.num_consumed_tokens == 0
    ahead.token_ids.append(a)  # the step in flight sampled "a" for it
    del requests[3]  # and ended the other (its token of step 7 is dropped)
    masks = masks_after(pending, requests.get)
    assert masks.step_id == 7 and masks.seq_ids == [1]
    assert allowed_ids(masks.allowed_token_bitmask) == {b}
    assert ahead.grammar.num_consumed_tokens == 1
    decoded = step_codec.decode_masks(wire.decode(wire.encode(step_codec.encode_masks(masks))))
    assert decoded == masks


def test_a_plan_without_an_ahead_constrained_row_has_no_masks_to_follow(compiler):
    grammar = compiler.compile(ValidConstraint("regex", "a+b"), TINY_VOCAB_SIZE, [EOS])
    requests = {1: running("known", grammar), 2: running("free", None)}
    plan = StepPlan(step_id=1, seq_ids=[1, 2], sample=[True, True], last_sampled_rows=[1])
    assert fill_masks(plan, requests.get, TINY_VOCAB_SIZE) is None
    assert not plan.masks_follow and plan.allowed_token_rows == [0]
