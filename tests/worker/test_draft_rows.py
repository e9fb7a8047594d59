"""Speculative rows, the worker's side (protos/step.proto, StepPlan.draft_counts): a row that
feeds its last token and d drafts samples d + 1 tokens, and each is the token, logprob and
top logprobs, bit for bit, that decoding one token at a time samples at its position, for
as long as the drafts before it were right. The worker returns every sample; the toy
scheduler keeps those equal to the drafts plus one, as the real one does, and rewinds
over the rest (the history and K/V the rejected drafts wrote are overwritten)."""

from __future__ import annotations

import random

import pytest

from pagoda.common.dummy_tokens import dummy_next_token
from pagoda.common.step_codec import decode_plan, result_problem
from pagoda.gpu_worker.dummy_engine import DUMMY_VOCAB_SIZE, DummyEngine
from pagoda.gpu_worker.sequence_table import PENDING_TOKEN
from pagoda.protos import step_pb2
from tests.worker.conftest import TEST_BLOCK_SIZE, TEST_NUM_BLOCKS, random_prompts, run_plan
from tests.worker.test_batch_invariance import (
    BACKENDS,
    NUM_NEW_TOKENS,
    PATHS,
    SEEDS,
    TARGET,
    add_random_mates,
    alone,
    case_alone,
    models_under_test,
    sampling,
    traced_entries,
)
from tests.worker.test_sequence_table import admit, make_table, plan_of
from tests.worker.toy_scheduler import Job, ToyScheduler, split_into

MAX_DRAFTS = 4
NUM_TRIALS = 4  # per case: true drafts alone, then true or wrong ones among batch mates


def drafter(truth: list[int], rng: random.Random, vocab_size: int, *, wrong: bool):
    """Drafts of up to MAX_DRAFTS of `truth`'s next tokens (what decoding gives), never
    past its end; when `wrong`, most of them with a random one replaced by another id."""

    def draft(job: Job) -> list[int]:
        done = len(job.generated)
        drafts = truth[done : done + rng.randint(0, min(MAX_DRAFTS, len(truth) - done - 1))]
        if wrong and drafts and rng.random() < 0.7:
            index = rng.randrange(len(drafts))
            drafts[index] = (drafts[index] + rng.randrange(1, vocab_size)) % vocab_size
        return drafts

    return draft


def random_drafter(rng: random.Random, vocab_size: int):
    """0-3 random drafts: what a batch mate's n-gram guesses look like to the target."""
    return lambda job: [rng.randrange(vocab_size) for _ in range(rng.randint(0, 3))]


def drafted_run(engine, prompt, seed, draft, rng, *, mates: bool) -> ToyScheduler:
    """The target decoded NUM_NEW_TOKENS tokens with `draft`'s drafts, its prompt in 1-3
    random chunks (the last one carries drafts too), alone or among random mates that
    draft random tokens."""
    scheduler = ToyScheduler(
        engine, num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE, seed=rng.randrange(1000)
    )
    vocab_size = engine.facts.vocab_size
    for mate in add_random_mates(scheduler, rng) if mates else []:
        if rng.random() < 0.5:
            mate.drafter = random_drafter(rng, vocab_size)
    target = scheduler.add(
        TARGET,
        prompt,
        sampling=sampling(seed),
        chunk_sizes=split_into(len(prompt), rng.randint(1, 3), rng),
        admit_at_step=rng.randint(0, 4) if mates else 0,
    )
    target.drafter = draft
    scheduler.run(NUM_NEW_TOKENS)
    return scheduler


@PATHS
@SEEDS
@BACKENDS
def test_samples_after_drafts_are_what_decoding_one_token_at_a_time_gives(
    tiny_models, quantization, weights, seed, backend
):
    models, rng, prompt, expected = case_alone(
        tiny_models, quantization, weights, seed, backend, label="drafts-"
    )
    vocab_size = models.reference.config.vocab_size
    num_fed = num_kept = 0
    for trial in range(NUM_TRIALS):
        wrong = trial % 2 == 1
        engine = models.engine(quantization=quantization, attention_backend=backend)
        draft = drafter(expected[0], rng, vocab_size, wrong=wrong)
        scheduler = drafted_run(engine, prompt, seed, draft, rng, mates=trial > 0)
        target = scheduler.jobs[TARGET]
        got = traced_entries(scheduler, target.entries)
        assert got[0] == expected[0], f"trial {trial}: tokens differ"
        assert got[1:] == expected[1:], f"trial {trial}: same tokens, other logprobs"
        if not wrong:  # every sample after a right draft is right: all d + 1 are kept
            assert target.num_drafts_kept == target.num_drafts_fed
        num_fed += target.num_drafts_fed
        num_kept += target.num_drafts_kept
    assert 0 < num_kept < num_fed, "drafts were both kept and rejected"


def test_knobs_read_at_each_sample_point_are_those_of_its_position(llama_models):
    """min_new_tokens (by position), logit bias and banned ids, seeded draws: a draft row's
    samples are one-at-a-time decoding's with all of them on."""
    rng = random.Random(5)
    (prompt,) = random_prompts(1, seed=9, min_len=12, max_len=12)
    plain = sampling(11)
    plain.num_logprobs = 2
    first = ToyScheduler(llama_models.engine(), num_blocks=64, block_size=TEST_BLOCK_SIZE)
    unmasked = first.add(TARGET, prompt, sampling=plain)
    first.run(NUM_NEW_TOKENS)
    knobs = step_pb2.SamplingParams()
    knobs.CopyFrom(plain)
    # The tokens it sampled unmasked are pushed around: masks that change the stream.
    knobs.banned_token_ids[:] = sorted(set(unmasked.generated[4:6]))
    bias = sorted(set(unmasked.generated[6:9]) - set(knobs.banned_token_ids))
    knobs.logit_bias_token_ids[:] = bias
    knobs.logit_bias_values[:] = [-3.0] * len(bias)
    ending = sorted(set(unmasked.generated[:4]) - set(knobs.banned_token_ids))

    def run(draft) -> ToyScheduler:
        scheduler = ToyScheduler(llama_models.engine(), num_blocks=64, block_size=TEST_BLOCK_SIZE)
        job = scheduler.add(
            TARGET, prompt, sampling=knobs, min_new_tokens=3, min_tokens_banned_ids=ending
        )
        job.drafter = draft
        scheduler.run(NUM_NEW_TOKENS)
        return scheduler

    one_at_a_time = run(None)
    expected = traced_entries(one_at_a_time, one_at_a_time.jobs[TARGET].entries)
    assert expected[0] != unmasked.generated  # the knobs matter
    vocab_size = llama_models.reference.config.vocab_size
    for wrong in (False, True):
        scheduler = run(drafter(expected[0], rng, vocab_size, wrong=wrong))
        target = scheduler.jobs[TARGET]
        assert target.num_drafts_fed > 0
        assert traced_entries(scheduler, target.entries) == expected


@pytest.mark.parametrize("seed", [None, 13], ids=["greedy", "seeded"])
@BACKENDS
def test_penalties_count_the_drafts_before_each_sample_point(tiny_models, seed, backend):
    """Repetition, presence and frequency penalties: the sample after the j-th draft reads
    counts that hold drafts 1..j, as decoding one token at a time would have counted them
    (the worker counts a row's drafts for good only once the next row shows them kept)."""
    models = models_under_test(tiny_models, "none", "float", backend)
    rng = random.Random(f"penalties-{seed}-{backend}")
    (prompt,) = random_prompts(1, seed=12, min_len=14, max_len=14)
    plain = sampling(seed)
    knobs = step_pb2.SamplingParams()
    knobs.CopyFrom(plain)
    knobs.repetition_penalty, knobs.presence_penalty, knobs.frequency_penalty = 1.3, 0.4, 0.3

    def run(draft, params) -> ToyScheduler:
        engine = models.engine(attention_backend=backend)
        scheduler = ToyScheduler(engine, num_blocks=64, block_size=TEST_BLOCK_SIZE)
        job = scheduler.add(TARGET, prompt, sampling=params)
        job.drafter = draft
        scheduler.run(NUM_NEW_TOKENS)
        return scheduler

    one_at_a_time = run(None, knobs)
    expected = traced_entries(one_at_a_time, one_at_a_time.jobs[TARGET].entries)
    unpenalized = run(None, plain)
    assert expected != traced_entries(unpenalized, unpenalized.jobs[TARGET].entries)
    vocab_size = models.reference.config.vocab_size
    for wrong in (False, True):
        scheduler = run(drafter(expected[0], rng, vocab_size, wrong=wrong), knobs)
        target = scheduler.jobs[TARGET]
        assert target.num_drafts_fed > 0
        assert traced_entries(scheduler, target.entries) == expected, f"wrong drafts: {wrong}"


def test_the_padded_piecewise_forward_samples_drafts_as_decoding_does(llama_models):
    """The padded piecewise forward (run eagerly on a CPU) keeps the logits at every
    sample point of a draft row too."""
    from tests.worker.test_piecewise_graphs import piecewise_engine

    rng = random.Random(3)
    (prompt,) = random_prompts(1, seed=31, min_len=30, max_len=30)
    expected = alone(llama_models, "none", "reference", prompt, None)
    steps: list[int] = []
    engine = piecewise_engine(llama_models, steps)
    vocab_size = llama_models.reference.config.vocab_size
    draft = drafter(expected[0], rng, vocab_size, wrong=True)
    scheduler = drafted_run(engine, prompt, None, draft, rng, mates=True)
    target = scheduler.jobs[TARGET]
    assert target.num_drafts_fed > 0 and steps
    assert traced_entries(scheduler, target.entries) == expected


# -- admission, sample points, packing and the result ----------------------------------------


def drafted(plan: step_pb2.StepPlan, *counts: int) -> step_pb2.StepPlan:
    plan.draft_counts.extend(counts)
    return plan


def test_a_draft_row_samples_after_each_of_its_last_tokens_and_history_holds_the_drafts():
    table = make_table()
    admit(table, plan_of([(1, 0, [10, 11, 12], [0])], new=[(1, [], 3)]))
    plan = drafted(
        plan_of([(2, 0, [5, 6], [2]), (1, 3, [13, 40, 41], [1]), (3, 0, [7], [3], False)],
                new=[(2, [], 2), (3, [], 2)]),
        0, 2, 0,
    )  # fmt: skip
    admitted, refusals = admit(table, plan)
    assert refusals == {}
    rows = table.sampling_rows(admitted)
    assert rows.rows == [0, 1, 1, 1]
    assert [seq.seq_id for seq in rows.sequences] == [2, 1, 1, 1]
    assert rows.positions == [2, 4, 5, 6]  # after 13 (position 3), 40 and 41
    assert rows.drafted_seq_ids == {1}
    assert admitted.sampled_seq_ids() == [2, 1, 1, 1]
    assert table.get(1).token_ids == [10, 11, 12, 13, 40, 41]

    # The scheduler picks the last token among the samples: the worker knows none.
    table.expect_sampled(rows)
    assert table.get(1).last_sampled_position == -1
    assert table.get(2).last_sampled_token_id == PENDING_TOKEN
    table.record_sampled(rows, [70, 40, 50, 60])
    assert table.get(1).last_sampled_position == -1
    assert (table.get(2).last_sampled_token_id, table.get(2).last_sampled_position) == (70, 2)

    # 40 was kept, 41 not (the sample after 40 was 50): the next row starts after 40 and
    # overwrites what 41 wrote.
    _, refusals = admit(table, plan_of([(1, 5, [50], [])], step_id=2))
    assert refusals == {} and table.get(1).token_ids == [10, 11, 12, 13, 40, 50]


def test_a_placeholder_row_after_a_draft_row_is_refused():
    """The last token of a draft row is the scheduler's pick, never fed as a placeholder."""
    engine = DummyEngine(block_size=4)
    run_plan(engine, drafted(plan_of([(1, 0, [10, 11, 12], [0])], new=[(1, [], 2)]), 1))
    placeholder = plan_of([(1, 3, [0], [])], step_id=2)
    placeholder.last_sampled_rows.append(0)
    result = run_plan(engine, placeholder)
    assert "sampled no token" in result.errors[0].message


def test_the_packed_batch_keeps_logits_before_each_sample_point():
    import torch

    from pagoda.gpu_worker.ragged_batch import build_ragged_batch

    table = make_table()
    admit(
        table, plan_of([(1, 0, [10, 11, 12], [0]), (2, 0, [20], [1])], new=[(1, [], 3), (2, [], 1)])
    )
    plan = drafted(
        plan_of([(3, 0, [30, 31, 32], [2]), (1, 3, [13, 40, 41], [3]), (2, 1, [21], [])],
                new=[(3, [], 3)]),
        1, 2, 0,
    )  # fmt: skip
    admitted, _ = admit(table, plan)
    batch = build_ragged_batch(admitted, table, 4, torch.device("cpu"))
    # Packed: row 2's one token first, then rows 0 and 1 as fed.
    assert batch.input_ids[0].tolist() == [21, 30, 31, 32, 13, 40, 41]
    assert batch.sample_token_indices.tolist() == [2, 3, 4, 5, 6, 0]
    sampling = table.sampling_rows(admitted)
    positions = batch.position_ids[0][batch.sample_token_indices].tolist()
    assert [p + 1 for p in positions] == sampling.positions


def refused_draft_row(tokens, count, kind, setup) -> str:
    """Sequence 1 (prompt 10, 11, 12, one token sampled) feeds `tokens` from position 3
    with `count` drafts in a row of `kind` ("plain", "no sample", "placeholder"), beside sequence 2's draft row; `setup` edits the first plan. The row
    must be refused, the rest run: the refusal's message."""
    engine = DummyEngine(block_size=4)
    first = plan_of(
        [(1, 0, [10, 11, 12], [0]), (2, 0, [20, 21], [1])], new=[(1, [], 3), (2, [], 2)]
    )
    if setup is not None:
        setup(first)
    run_plan(engine, first)
    row = (1, 3, tokens, [4], kind != "no sample")
    plan = drafted(plan_of([row, (2, 2, [22, 23], [])], step_id=2), count, 1)
    if kind == "placeholder":
        plan.last_sampled_rows.append(0)
    result = run_plan(engine, plan)
    assert 1 not in engine.table and [e.seq_id for e in result.errors] == [1]
    assert list(result.seq_ids) == [2, 2]  # the draft row after the refused one still runs
    assert list(result.token_ids) == [
        dummy_next_token(22, 2, DUMMY_VOCAB_SIZE),
        dummy_next_token(23, 3, DUMMY_VOCAB_SIZE),
    ]
    assert result_problem(plan, result, DUMMY_VOCAB_SIZE) is None
    return result.errors[0].message


@pytest.mark.parametrize(
    ("tokens", "count", "kind", "setup", "message"),
    [
        ([13, 40], 1, "no sample", None, "does not sample"),
        ([13, 40], 2, "plain", None, "feeds 2 tokens with 2 drafts"),
        ([0], 1, "placeholder", None, "last_sampled row"),
    ],
)
def test_a_draft_row_that_cannot_sample_as_decoding_would_is_refused(
    tokens, count, kind, setup, message
):
    assert message in refused_draft_row(tokens, count, kind, setup)


def only(*token_ids: int) -> bytes:
    """An allowed-token bitmask of the dummy's vocabulary that allows just `token_ids`."""
    mask = bytearray(DUMMY_VOCAB_SIZE // 8)
    for token_id in token_ids:
        mask[token_id // 8] |= 1 << (token_id % 8)
    return bytes(mask)


def test_a_constrained_draft_row_samples_each_point_under_its_own_mask():
    """Protocol 7: a constrained row with d drafts has d + 1 masks, one per sample point in
    position order; a refused row's masks leave with it and the others keep theirs."""
    engine = DummyEngine(block_size=4)
    run_plan(
        engine,
        plan_of([(1, 0, [10, 11, 12], [0]), (2, 0, [20, 21], [1])], new=[(1, [], 3), (2, [], 2)]),
    )
    plan = drafted(
        plan_of([(9, 0, [5], [2]), (1, 3, [13, 40, 41], [3]), (2, 2, [22], [])], step_id=2),
        0, 2, 0,
    )  # fmt: skip
    plan.allowed_token_rows.extend([0, 1, 2])  # sequence 9 is unknown: refused
    plan.allowed_token_bitmask = only(50) + only(60) + only(61) + only(62) + only(70)
    result = run_plan(engine, plan)
    assert [e.seq_id for e in result.errors] == [9] and not result.step_error
    assert list(result.seq_ids) == [1, 1, 1, 2]
    assert list(result.token_ids) == [60, 61, 62, 70]  # each point's own mask


def test_a_constrained_draft_row_with_one_mask_fails_the_step():
    engine = DummyEngine(block_size=4)
    run_plan(engine, plan_of([(1, 0, [10, 11, 12], [0])], new=[(1, [], 3)]))
    plan = drafted(plan_of([(1, 3, [13, 40, 41], [3])], step_id=2), 2)
    plan.allowed_token_rows.append(0)
    plan.allowed_token_bitmask = only(60)
    assert "sample 3 tokens" in run_plan(engine, plan).step_error


@pytest.mark.parametrize("counts", [[1], [1, 0, 0], [0, -1]])
def test_draft_counts_not_one_per_row_fail_the_step(counts):
    engine = DummyEngine(block_size=4)
    plan = decode_plan(
        plan_of([(1, 0, [10, 11], [0]), (2, 0, [20, 21], [1])], new=[(1, [], 2), (2, [], 2)])
    )
    plan.draft_counts = counts
    result = engine.step(plan)
    assert "draft_counts" in result.step_error
    assert len(engine.table) == 0


def test_masks_that_follow_a_plan_may_not_constrain_a_draft_row():
    from pagoda.common.step import StepMasks

    engine = DummyEngine(block_size=4)
    engine.wait_masks = lambda step_id: StepMasks(step_id, [1], b"\xff" * (DUMMY_VOCAB_SIZE // 8))
    plan = drafted(plan_of([(1, 0, [10, 11], [0])], new=[(1, [], 1)]), 1)
    plan.masks_follow = True
    assert "whose row has drafts" in run_plan(engine, plan).step_error


def test_the_dummy_engine_answers_draft_rows_as_one_token_at_a_time():
    """Its samples after each draft are dummy_next_token of the fed token before them,
    min_new_tokens masked by position; the result lists each sample, with logprobs."""
    rng = random.Random(1)
    knobs = step_pb2.SamplingParams(num_logprobs=2, banned_token_ids=[5])
    prompt = [10, 11, 12, 13, 14]
    # 3 tokens must come before the "ending" ids; make them the unmasked picks' ids.
    ending = [dummy_next_token(prompt[-1], len(prompt) - 1, DUMMY_VOCAB_SIZE)]

    def run(draft) -> ToyScheduler:
        scheduler = ToyScheduler(DummyEngine(block_size=4), num_blocks=64, block_size=4)
        job = scheduler.add(
            1, prompt, sampling=knobs, chunk_sizes=[2], min_new_tokens=3,
            min_tokens_banned_ids=ending,
        )  # fmt: skip
        job.drafter = draft
        scheduler.run(20)
        return scheduler

    expected = run(None).jobs[1].generated
    assert expected[0] != ending[0]
    for wrong in (False, True):
        scheduler = run(drafter(expected, rng, DUMMY_VOCAB_SIZE, wrong=wrong))
        job = scheduler.jobs[1]
        assert job.generated == expected and job.num_drafts_fed > 0
        for result in scheduler.results:
            if result.seq_ids:  # one logprob and two alternatives per sample
                assert len(result.logprobs) == len(result.seq_ids) == len(result.top_offsets) - 1
                assert result.top_offsets[-1] == 2 * len(result.seq_ids)


def test_the_result_lists_each_sample_and_passes_the_schedulers_check():
    engine = DummyEngine(block_size=4)
    plan = drafted(
        plan_of([(1, 0, [10, 11, 12], [0]), (2, 0, [20, 21, 22, 23, 24], [1, 2]),
                 (3, 0, [30], [3], False)],
                new=[(1, [], 3), (2, [], 2), (3, [], 4)]),
        0, 3, 0,
    )  # fmt: skip
    for new in plan.new_sequences:
        new.sampling.num_logprobs = 1
    result = run_plan(engine, plan)
    assert list(result.seq_ids) == [1, 2, 2, 2, 2]
    assert list(result.token_ids) == [
        dummy_next_token(12, 2, DUMMY_VOCAB_SIZE),
        *(
            dummy_next_token(t, p, DUMMY_VOCAB_SIZE)
            for t, p in [(21, 1), (22, 2), (23, 3), (24, 4)]
        ),
    ]
    assert list(result.top_offsets) == [0, 1, 2, 3, 4, 5]
    assert result_problem(plan, result, DUMMY_VOCAB_SIZE) is None
