"""N-gram speculation in the scheduler core (core/speculation.py): the drafts it proposes,
and that a request streams exactly what decoding one token at a time streams, whatever
the drafts, the stop rules that cut a run of kept samples, and the blocks they complete.

The model here is a fake worker's `next_token` that repeats itself (a cycle of tokens,
broken at some positions), so drafts are often right and sometimes wrong."""

from __future__ import annotations

import dataclasses
import itertools
from array import array

import pytest

from pagoda.common.step import SamplingParams
from pagoda.common.step_codec import encode_hello, geometry_from_hello
from pagoda.gpu_worker.dummy_engine import DummyEngine
from pagoda.scheduler_svc.core import FinishReason, Scheduler, SchedulerConfig
from pagoda.scheduler_svc.core.config import DEFAULT_SPECULATIVE_TOKENS
from pagoda.scheduler_svc.core.request import RequestState
from pagoda.scheduler_svc.core.speculation import (
    MAX_PAUSE_STEPS,
    acceptance,
    draft_price,
    num_kept,
    num_worth_drafting,
    propose,
)
from pagoda.scheduler_svc.core.step_budget import StepCostModel
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import drive, make_geometry, make_request, make_scheduler

CYCLE = 7  # the model counts up modulo this, from the last token


def cyclic(last_token_id: int, last_position: int, vocab_size: int, banned=()) -> int:
    """A model whose output repeats: the token after `last`, in a cycle of CYCLE, except
    at every 11th position, where it skips one (a draft read from the cycle is wrong)."""
    step = 2 if last_position % 11 == 10 else 1
    token_id = (last_token_id - 3 + step) % CYCLE + 3
    while token_id in banned:
        token_id = (token_id + 1) % vocab_size
    return token_id


def tokens(*values: int) -> array:
    return array("q", values)


# -- proposing ---------------------------------------------------------------------------------


def test_propose_follows_the_latest_earlier_occurrence_of_the_longest_suffix():
    # "1 2 3" occurred at 0 (then 9) and "2 3" at 4 (then 7): the 3-gram wins.
    history = tokens(1, 2, 3, 9, 2, 3, 7, 5, 1, 2, 3)
    assert propose(history, 2, 3, 4) == [9, 2, 3, 7]
    # Only 2-grams looked up: the latest "2 3" before the end is at 4.
    assert propose(history, 2, 2, 2) == [7, 5]
    # The latest of several occurrences: "5 5" at 1 and at 2 (overlapping the suffix).
    assert propose(tokens(4, 5, 5, 5), 2, 2, 3) == [5]


def test_propose_gives_nothing_without_a_repeat_or_room():
    assert propose(tokens(1, 2, 3, 4), 1, 3, 4) == []
    assert propose(tokens(1, 2, 1, 2), 2, 2, 0) == []
    assert propose(tokens(7), 1, 4, 4) == []
    # The continuation stops at the end of what is known.
    assert propose(tokens(1, 2, 1, 2), 2, 2, 5) == [1, 2]


def test_propose_matches_whole_tokens_only():
    # 1's eight bytes (01 00 ... 00) occur one byte into (0x0100, 0): no token 1 there.
    assert propose(tokens(0x0100, 0, 5, 1), 1, 1, 2) == []
    assert propose(tokens(0x0100, 0, 1, 7, 1), 1, 1, 2) == [7, 1]
    assert propose(tokens(0x0100, 0x0001_0000, 1, 0x0100), 1, 1, 2) == [0x0001_0000, 1]


def test_num_kept_keeps_the_agreeing_samples_then_one():
    assert num_kept([], [5]) == 1
    assert num_kept([5, 6, 7], [5, 6, 7, 8]) == 4
    assert num_kept([5, 6, 7], [5, 9, 7, 8]) == 2
    assert num_kept([5, 6, 7], [4, 6, 7, 8]) == 1


def test_a_draft_is_fed_when_its_chance_beats_its_price():
    assert num_worth_drafting(0.9, 0.5, 8) == 6  # 0.9 ** 6 = 0.53, 0.9 ** 7 = 0.48
    assert num_worth_drafting(0.9, 0.5, 3) == 3
    assert num_worth_drafting(0.4, 0.5, 8) == 0
    assert acceptance(0, 0) == 0.5  # a new request drafts
    assert acceptance(0, 4) < draft_price(None, 1, 100)  # four misses: a lone one stops
    # More decoders in the step: each draft costs all of them, so it needs a better chance.
    prices = [draft_price(None, n, 100 * n) for n in (1, 2, 8, 32)]
    assert prices == sorted(prices) and prices[0] > 0 and prices[-1] < 1


def test_the_price_comes_from_the_learned_step_cost():
    model = StepCostModel()
    # 4 ms + 0.5 per decoder + 0.6 per prompt token (+ a little per context token).
    for num_prefill, num_decode, num_context in [(0, 1, 50), (64, 0, 64), (0, 8, 900)] * 6:
        step_ms = 4 + 0.6 * num_prefill + 0.5 * num_decode + 0.001 * num_context
        model.observe(num_prefill, num_decode, step_ms, num_context)
    assert draft_price(model, 1, 100) == pytest.approx(0.6 / 4.6, rel=0.1)
    assert draft_price(model, 8, 800) == pytest.approx(8 * 0.6 / 8.8, rel=0.1)


# -- the scheduler -----------------------------------------------------------------------------


def run(requests, *, speculative_tokens: int, geometry=None, **knobs):
    """Every request's stream, the scheduler's stats and its plans, on the cyclic model."""
    geometry = geometry or make_geometry(num_kv_blocks=64, block_size=4, vocab_size=40)
    scheduler = make_scheduler(geometry, speculative_tokens=speculative_tokens, **knobs)
    worker = FakeWorker(geometry, next_token=cyclic)
    for request in requests:
        scheduler.add(request, now=0.0)
    plans = []
    streams = drive(scheduler, worker, on_step=lambda _, plan: plans.append(plan))
    return streams, scheduler.stats, plans


def cyclic_prompt(length: int = 12) -> list[int]:
    return [index % CYCLE + 3 for index in range(length)]


@pytest.mark.parametrize("speculative_tokens", [1, 3, 8])
def test_the_same_stream_in_fewer_steps(speculative_tokens):
    requests = [
        make_request("r0", cyclic_prompt(), max_new_tokens=40, num_logprobs=2),
        make_request("r1", cyclic_prompt(5), max_new_tokens=33),
        make_request("r2", [30, 20, 31, 21, 32], max_new_tokens=20),  # no repeat at first
    ]
    plain, plain_stats, plain_plans = run(requests, speculative_tokens=0)
    drafted, stats, plans = run(requests, speculative_tokens=speculative_tokens)
    for request in requests:
        request_id = request.request_id
        assert drafted[request_id].token_ids == plain[request_id].token_ids
        assert drafted[request_id].text == plain[request_id].text
        assert drafted[request_id].finish_reason is FinishReason.LENGTH
        assert drafted[request_id].usage == plain[request_id].usage
        assert drafted[request_id].num_events_after_finish == 0
    assert plain_stats.num_draft_tokens == 0
    assert stats.num_draft_tokens > stats.num_accepted_draft_tokens > 0
    assert stats.num_generated_tokens == plain_stats.num_generated_tokens
    assert len(plans) < len(plain_plans)
    # As many drafts as asked for, or as the table's last block holds (block size 4).
    assert max(max(plan.draft_counts, default=0) for plan in plans) == min(speculative_tokens, 3)
    # The skipped positions make some drafts wrong: the rejection path ran too.
    assert (
        any(plan.draft_counts and plan.num_draft_tokens for plan in plans)
        and stats.num_draft_tokens - stats.num_accepted_draft_tokens > 0
    )


class RefusesFive:
    """A grammar that refuses token 5 (core.request.Grammar): the fake worker does not mask,
    so only the drafts change."""

    def __init__(self) -> None:
        self.num_asked = 0

    def forced_tokens(self, request) -> list[int]:
        return []

    def num_allowed(self, request, token_ids: list[int]) -> int:
        self.num_asked += 1
        return token_ids.index(5) if 5 in token_ids else len(token_ids)


def test_a_grammar_trims_the_drafts_it_would_refuse():
    grammar = RefusesFive()
    constrained = dataclasses.replace(
        make_request("r0", cyclic_prompt(), max_new_tokens=30), grammar=grammar
    )
    plain, _, _ = run(
        [make_request("r0", cyclic_prompt(), max_new_tokens=30)], speculative_tokens=4
    )
    drafted, stats, plans = run([constrained], speculative_tokens=4)
    assert drafted["r0"].token_ids == plain["r0"].token_ids
    assert grammar.num_asked > 0 and stats.num_draft_tokens > 0
    for plan in plans:
        for row, num_drafts in enumerate(plan.draft_counts):
            end = plan.token_offsets[row + 1]
            assert 5 not in plan.token_ids[end - num_drafts : end]


class Forces:
    """A grammar that forces the next 3 tokens of `output` (core.request.Grammar), or 3
    other ones: the fake worker does not mask, so only the drafts change."""

    def __init__(self, output: list[int], right: bool) -> None:
        self.output = output
        self.right = right
        self.records: list[tuple[float, float]] = []  # the request's, at each ask

    def forced_tokens(self, request) -> list[int]:
        self.records.append((request.num_kept_drafts, request.num_tried_drafts))
        upcoming = self.output[request.num_generated_tokens :][:3]
        return upcoming if self.right else [token ^ 1 for token in upcoming]

    def num_allowed(self, request, token_ids: list[int]) -> int:
        raise AssertionError("a forcing grammar is not asked about n-gram drafts")


@pytest.mark.parametrize("right", [True, False])
def test_a_grammar_that_forces_tokens_drafts_them(right):
    """Whatever the n-gram would propose (the prompt repeats), the forced tokens are the
    drafts: kept when the model writes them, dropped when it does not, and the output is
    decoding's either way."""
    plain, _, plain_plans = run(
        [make_request("r0", cyclic_prompt(), max_new_tokens=30)], speculative_tokens=0
    )
    output = plain["r0"].token_ids
    grammar = Forces(output, right)
    constrained = dataclasses.replace(
        make_request("r0", cyclic_prompt(), max_new_tokens=30), grammar=grammar
    )
    drafted, stats, plans = run([constrained], speculative_tokens=4)
    assert drafted["r0"].token_ids == output
    assert stats.num_draft_tokens > 0
    # Forced drafts say nothing of the n-gram's chances: its record stays clean.
    assert len(grammar.records) > 1 and set(grammar.records) == {(0.0, 0.0)}
    if right:
        assert stats.num_accepted_draft_tokens == stats.num_draft_tokens
        assert len(plans) < len(plain_plans)
    else:
        assert stats.num_accepted_draft_tokens == 0


@pytest.mark.parametrize(
    "stopping",
    [
        {"stop_token_ids": [6]},  # a stop token inside a run of kept samples
        {"stop_strings": ("jd",)},  # a stop string that ends inside a run
        {"stop_strings": ("fgh",), "max_new_tokens": 9},
        {"max_new_tokens": 6},  # the length limit inside a run
        {"min_new_tokens": 12, "stop_token_ids": [4]},  # the ending id masked for a while
    ],
)
def test_stop_rules_cut_a_run_where_decoding_stops(stopping):
    knobs = {"max_new_tokens": 30, **stopping}
    requests = [make_request("r0", cyclic_prompt(), num_logprobs=1, **knobs)]
    plain, _, _ = run(requests, speculative_tokens=0)
    drafted, stats, _ = run(requests, speculative_tokens=6)
    assert stats.num_accepted_draft_tokens > 0
    assert drafted["r0"].token_ids == plain["r0"].token_ids
    assert drafted["r0"].text == plain["r0"].text
    assert drafted["r0"].finish_reason is plain["r0"].finish_reason
    assert drafted["r0"].usage == plain["r0"].usage
    if "stop_strings" in stopping:
        assert drafted["r0"].finish_reason is FinishReason.STOP


def test_accepted_drafts_complete_blocks_that_later_prompts_hit():
    first = make_request("r0", cyclic_prompt(), max_new_tokens=30)
    plain, _, _ = run([first], speculative_tokens=0)
    # A second prompt: the first one's prompt and output. Its cached part is the same
    # whether the first one's blocks were completed by drafts or one token at a time.
    follow = make_request("r1", [*cyclic_prompt(), *plain["r0"].token_ids, 3])
    results = []
    for speculative_tokens in (0, 5):
        geometry = make_geometry(num_kv_blocks=64, block_size=4, vocab_size=40)
        scheduler = make_scheduler(geometry, speculative_tokens=speculative_tokens)
        worker = FakeWorker(geometry, next_token=cyclic)
        scheduler.add(first, now=0.0)
        streams = drive(scheduler, worker)
        scheduler.add(follow, now=1.0)
        streams = drive(scheduler, worker, streams)
        results.append(streams["r1"].usage.cached_prompt_tokens)
    assert results[0] == results[1] == (len(follow.prompt_token_ids) - 1) // 4 * 4


def test_penalties_draft_but_big_batches_do_not():
    # The worker counts the drafts before each sample point (tests/worker/test_draft_rows).
    penalized = dataclasses.replace(
        make_request("r0", cyclic_prompt(), max_new_tokens=20),
        sampling=SamplingParams(repetition_penalty=1.2),
    )
    _, stats, plans = run([penalized], speculative_tokens=4)
    assert stats.num_draft_tokens > 0
    many = [make_request(f"r{i}", cyclic_prompt(), max_new_tokens=6 + 20 * i) for i in range(3)]
    _, stats, plans = run(many, speculative_tokens=4, speculative_max_batch=2)
    assert all(not plan.num_draft_tokens for plan in plans if plan.num_decode_tokens > 2)
    assert stats.num_draft_tokens > 0  # once the first one finished


def test_no_drafts_while_a_prompt_is_to_be_computed():
    """A draft takes a prompt token's place. The first request drafts nothing while the
    second's prompt goes in, chunk by chunk (8 tokens a step), then drafts again; with one
    slot, the second only waits for the first to end, and the first drafts all along."""
    first = make_request("r0", cyclic_prompt(), max_new_tokens=30)
    second = make_request("r1", [20 + i % 9 for i in range(48)], max_new_tokens=4)
    geometry = make_geometry(num_kv_blocks=64, block_size=4, vocab_size=40)
    for max_active, drafts_while_second_prefills in ((8, False), (1, True)):
        scheduler = make_scheduler(
            geometry, speculative_tokens=3, max_num_batched_tokens=8, max_active_requests=max_active
        )
        worker = FakeWorker(geometry, next_token=cyclic)
        scheduler.add(first, now=0.0)
        for _ in range(4):  # the first one decodes
            scheduler.apply(worker.step(scheduler.schedule(now=0.0)), now=0.0)
        scheduler.add(second, now=1.0)
        drafted = []
        for _ in range(3):  # waiting, then prefilling (48 tokens, 8 a step, beside a decode)
            plan = scheduler.schedule(now=1.0)
            drafted.append(plan.num_draft_tokens > 0)
            scheduler.apply(worker.step(plan), now=1.0)
        assert scheduler.core._requests["r1"].state is not RequestState.WAITING or max_active == 1
        assert any(drafted) is drafts_while_second_prefills
        streams = drive(scheduler, worker)
        assert streams["r1"].finish_reason is FinishReason.LENGTH


def test_a_request_whose_drafts_fail_pauses_them():
    """The dummy model over 29 tokens: n-grams repeat, their continuations do not. Its
    drafts are tried, fail, and pause for longer and longer."""
    geometry = make_geometry(num_kv_blocks=64, block_size=16, vocab_size=29)
    scheduler = make_scheduler(geometry, speculative_tokens=4, speculative_ngram_min=1)
    worker = FakeWorker(geometry)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3, 4, 5]
    scheduler.add(make_request("r0", prompt, max_new_tokens=200), now=0.0)
    plans = []
    drive(scheduler, worker, on_step=lambda _, plan: plans.append(plan))
    drafted_steps = [index for index, plan in enumerate(plans) if plan.num_draft_tokens]
    assert scheduler.stats.num_accepted_draft_tokens == 0
    assert 5 <= len(drafted_steps) < len(plans) // 4
    gaps = [b - a for a, b in itertools.pairwise(drafted_steps)]
    assert max(gaps) >= MAX_PAUSE_STEPS  # the pause grew to its longest
    assert drafted_steps[-1] > len(plans) // 2  # and it still tries now and then


def test_drafts_keep_to_the_token_budget_and_the_table():
    requests = [make_request(f"r{i}", cyclic_prompt(9), max_new_tokens=25) for i in range(3)]
    _, stats, plans = run(requests, speculative_tokens=8, max_num_batched_tokens=6)
    assert stats.num_accepted_draft_tokens > 0
    for plan in plans:
        assert plan.num_tokens <= 6
        for index, count in enumerate(plan.draft_counts):
            if count:  # never past its table's last block (block size 4): no new block
                end = plan.start_positions[index] + count + 1
                assert -(-end // 4) == plan.start_positions[index] // 4 + 1


def test_speculation_plans_one_step_at_a_time():
    scheduler = make_scheduler(speculative_tokens=2)
    scheduler.add(make_request("r0", cyclic_prompt(), max_new_tokens=4), now=0.0)
    assert scheduler.schedule(now=0.0) is not None
    assert not scheduler.can_plan_ahead


@pytest.mark.parametrize(
    ("knob", "batch_invariant", "overlapped", "expected"),
    [
        (None, True, False, DEFAULT_SPECULATIVE_TOKENS),  # a CPU worker, one step at a time
        (None, False, False, 0),  # CUDA: a draft's logits may differ in their last bits
        (None, True, True, 0),  # steps planned ahead: no token is known to draft from
        (2, False, True, 2),
        (0, True, False, 0),
    ],
)
def test_unset_speculation_is_on_where_drafts_cannot_change_a_token(
    knob, batch_invariant, overlapped, expected
):
    geometry = dataclasses.replace(make_geometry(), batch_invariant=batch_invariant)
    scheduler = Scheduler(SchedulerConfig(speculative_tokens=knob))
    scheduler.attach_worker(geometry, overlapped=overlapped)
    assert scheduler._planner.speculative_tokens == expected
    assert scheduler.can_plan_ahead is False  # nothing in flight either way


def test_the_hello_says_whether_a_worker_is_batch_invariant():
    hello = encode_hello(DummyEngine().facts, protocol_version=1, incarnation_id="w")
    assert geometry_from_hello(hello).batch_invariant is True
    hello.batch_invariant = False
    assert geometry_from_hello(hello).batch_invariant is False
