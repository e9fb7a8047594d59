"""min_new_tokens on the worker: the ending ids are masked out of the logits until the
sequence has generated that many tokens (issue 14 item 6), greedy and sampled, after a
recompute too, and token for token as transformers' generate(min_new_tokens=...)."""

from __future__ import annotations

import pytest
import torch

from pagoda.common import step_codec
from pagoda.common.step import NewSequence, SamplingParams, StepPlan
from pagoda.gpu_worker.sampler import SampleRow, mask_min_new_tokens, sample
from pagoda.gpu_worker.sequence_table import SequenceTable
from pagoda.protos import step_pb2
from tests.worker.conftest import TEST_BLOCK_SIZE, TEST_NUM_BLOCKS, random_prompts
from tests.worker.toy_scheduler import ToyScheduler

VOCAB = 32
EOS = 5
STOP = 9


def eos_heavy_logits(num_rows: int = 1) -> torch.Tensor:
    """EOS is the argmax by far, then the stop id, then token 1."""
    logits = torch.zeros(num_rows, VOCAB)
    logits[:, EOS] = 30.0
    logits[:, STOP] = 20.0
    logits[:, 1] = 10.0
    return logits


def masked_row(
    params: SamplingParams, history: list[int], num_prompt: int, position: int, mask=(0, ())
) -> SampleRow:
    """A SampleRow whose sequence masks mask[1] until mask[0] tokens were generated."""
    min_new_tokens, banned_ids = mask
    return SampleRow(params, history, num_prompt, position, None, min_new_tokens, banned_ids)


def decode(params: SamplingParams, num_steps: int, prompt=(3, 4), mask=(0, ())) -> list[int]:
    """Sample num_steps tokens one at a time, feeding each back (logits never change)."""
    history = list(prompt)
    for _ in range(num_steps):
        row = masked_row(params, history, len(prompt), len(history), mask)
        history.append(sample(eos_heavy_logits(), [row]).token_ids[0])
    return history[len(prompt) :]


@pytest.mark.parametrize(
    "knobs", [{}, {"temperature": 0.7, "seed": 11}, {"temperature": 1.0, "top_k": 3, "seed": 2}]
)
def test_ending_ids_are_masked_until_min_new_tokens(knobs):
    params = SamplingParams(**knobs)
    tokens = decode(params, 5, mask=(3, (EOS, STOP)))
    assert EOS not in tokens[:3] and STOP not in tokens[:3]
    assert tokens[3] == EOS  # the 4th token may end the request, and here does
    # Without the mask EOS comes first.
    assert decode(SamplingParams(**knobs), 1) == [EOS]


def test_mask_counts_generated_positions_not_history_length():
    """After a recompute the history holds generated tokens: positions from
    num_prompt_tokens on count, whatever was fed in this sequence's lifetime."""
    params, mask = SamplingParams(), (3, (EOS,))
    prompt = [3, 4, 6]
    generated_two = [*prompt, 7, 8]  # two generated: still masked
    generated_three = [*generated_two, 1]  # three generated: free
    rows = [
        masked_row(params, generated_two, len(prompt), len(generated_two), mask),
        masked_row(params, generated_three, len(prompt), len(generated_three), mask),
        SampleRow(SamplingParams(), generated_two, len(prompt), len(generated_two)),
    ]
    assert sample(eos_heavy_logits(3), rows).token_ids == [STOP, EOS, EOS]


def test_no_masked_row_returns_the_logits_untouched():
    logits = eos_heavy_logits(2)
    rows = [SampleRow(SamplingParams(), [1, 2], 2, 2)] * 2
    assert mask_min_new_tokens(logits, rows) is logits


def test_mask_is_per_row_in_a_mixed_batch():
    mask = (1, (EOS, STOP))
    rows = [
        masked_row(SamplingParams(), [1, 2], 2, 2, mask),
        SampleRow(SamplingParams(), [1, 2], 2, 2),
        masked_row(SamplingParams(), [1, 2], 2, 2, mask),
    ]
    out = sample(eos_heavy_logits(3), rows)
    assert out.token_ids == [1, EOS, 1]


def test_logprobs_follow_the_masked_distribution():
    params = SamplingParams(num_logprobs=2)
    out = sample(eos_heavy_logits(), [masked_row(params, [1], 1, 1, (1, (EOS,)))])
    assert out.token_ids == [STOP]
    assert out.top_token_ids == [[STOP, 1]]
    assert out.logprobs[0] == pytest.approx(0.0, abs=1e-3)


def test_codec_carries_the_mask_and_drops_half_of_one():
    def decoded(**fields) -> NewSequence:
        plan = step_pb2.StepPlan(new_sequences=[step_pb2.NewSequence(seq_id=1, **fields)])
        return step_codec.decode_plan(plan).new_sequences[0]

    params = decoded(min_new_tokens=4, min_tokens_banned_ids=[2, 7])
    assert (params.min_new_tokens, tuple(sorted(params.min_tokens_banned_ids))) == (4, (2, 7))
    assert decoded(min_new_tokens=4).min_new_tokens == 0  # no ids: nothing to mask
    assert tuple(decoded(min_tokens_banned_ids=[2]).min_tokens_banned_ids) == ()


def test_sequence_table_refuses_a_banned_id_outside_the_vocabulary():
    table = SequenceTable(
        num_kv_blocks=8, block_size=4, vocab_size=VOCAB, max_context_tokens=64, max_logprobs=5
    )
    plan = StepPlan(
        step_id=0,
        new_sequences=[
            NewSequence(
                seq_id=1,
                sampling=SamplingParams(),
                num_prompt_tokens=2,
                min_new_tokens=2,
                min_tokens_banned_ids=frozenset((EOS, VOCAB)),
            )
        ],
        seq_ids=[1],
        start_positions=[0],
        sample=[True],
        token_offsets=[0, 2],
        token_ids=[3, 4],
        block_offsets=[0, 1],
        block_ids=[0],
    )
    admitted, refusals = table.admit(plan)
    assert admitted.seq_ids == []
    assert list(refusals) == [1]
    assert "min_tokens_banned_ids" in refusals[1]
    assert 1 not in table


def test_paged_engine_matches_generate_with_min_new_tokens(llama_models):
    """Greedy parity with transformers. The ending ids are the model's own first choice
    (so the mask changes the output) and the token generate() picks right after
    min_new_tokens under that mask (so the sequence ends there, as soon as allowed)."""
    reference = llama_models.reference
    num_new_tokens, min_new_tokens = 12, 4

    def generate(prompt: list[int], eos_ids: list[int]) -> list[int]:
        input_ids = torch.tensor([prompt])
        return reference.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=num_new_tokens,
            min_new_tokens=min_new_tokens,
            eos_token_id=eos_ids,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()

    num_ended = 0
    for prompt in random_prompts(3, seed=21):
        first_choice = llama_models.greedy(prompt, 1)[0]
        eos_ids = [first_choice, generate(prompt, [first_choice])[min_new_tokens]]
        theirs = generate(prompt, eos_ids)
        ended = [i for i, t in enumerate(theirs) if t in eos_ids]
        if ended:  # generate pads after the end; our engine never stops by itself
            theirs = theirs[: ended[0] + 1]
            num_ended += ended[0] == min_new_tokens
        scheduler = ToyScheduler(
            llama_models.engine(), num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE
        )
        scheduler.add(0, prompt, min_new_tokens=min_new_tokens, min_tokens_banned_ids=eos_ids)
        ours = scheduler.run(num_new_tokens)[0]
        assert not set(ours[:min_new_tokens]) & set(eos_ids)
        assert ours[: len(theirs)] == theirs
    assert num_ended, "some prompt should end right at min_new_tokens"


def test_recomputed_sequence_stays_masked_until_min_new_tokens(llama_models):
    """A sequence recomputed after two generated tokens (its cached history now holds
    them) is still masked for the next two samples, then free."""
    (prompt,) = random_prompts(1, seed=22)
    scheduler = ToyScheduler(
        llama_models.engine(), num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE
    )
    unmasked = llama_models.greedy(prompt, 8)
    banned = sorted(set(unmasked))  # every token the model would pick unmasked
    scheduler.add(0, prompt, min_new_tokens=4, min_tokens_banned_ids=banned)
    scheduler.run(2)
    scheduler.recompute(0, 1)
    tokens = scheduler.run(4)[1]
    assert not set(tokens) & set(banned)
    scheduler.run(6)
    assert (
        scheduler.jobs[1].generated[4]
        == llama_models.greedy(prompt + scheduler.jobs[1].generated[:4], 1)[0]
    )
