"""logit_bias on the worker (issue 28 item 5): added to a row's logits before temperature
and the filters, so +100 makes greedy pick a token and -100 bans it, sampled rows too; a
row without a bias is untouched by a biased neighbour; malformed columns are refused."""

from __future__ import annotations

import pytest
import torch

from pagoda.common.step import NewSequence, SamplingParams, StepPlan
from pagoda.common.step_codec import decode_sampling
from pagoda.gpu_worker.sampler import SampleRow, apply_logit_bias, sample
from pagoda.gpu_worker.sequence_table import SequenceTable
from pagoda.protos import step_pb2

VOCAB = 32
FAVOURITE = 5  # the argmax of the test logits by far


def logits(num_rows: int = 1) -> torch.Tensor:
    values = torch.linspace(-3.0, 3.0, VOCAB).repeat(num_rows, 1)
    values[:, FAVOURITE] = 12.0
    return values


def biased(bias: dict[int, float], **knobs) -> SamplingParams:
    return SamplingParams(
        logit_bias_token_ids=tuple(bias), logit_bias_values=tuple(bias.values()), **knobs
    )


def row(params: SamplingParams, position: int = 3) -> SampleRow:
    return SampleRow(params, [1, 2, 3][:position], 2, position)


KNOBS = [{}, {"temperature": 1.0, "seed": 4}, {"temperature": 0.8, "top_k": 4, "seed": 9}]


@pytest.mark.parametrize("knobs", KNOBS)
def test_plus_100_forces_a_token(knobs):
    assert sample(logits(), [row(biased({17: 100.0}, **knobs))]).token_ids == [17]


@pytest.mark.parametrize("knobs", KNOBS)
def test_minus_100_bans_a_token(knobs):
    assert sample(logits(), [row(SamplingParams(**knobs))]).token_ids == [FAVOURITE]
    for position in range(3, 40):  # seeded draws at many positions never land on it
        params = biased({FAVOURITE: -100.0}, **knobs)
        assert sample(logits(), [row(params, position)]).token_ids[0] != FAVOURITE


def test_a_small_bias_shifts_the_logit_by_exactly_its_value():
    params = biased({0: 1.5, 31: -0.25})
    shifted = apply_logit_bias(logits(), [row(params)])
    expected = logits()
    expected[0, 0] += 1.5
    expected[0, 31] -= 0.25
    assert torch.equal(shifted, expected)


def test_only_the_biased_row_changes():
    plain, forced = SamplingParams(), biased({17: 100.0})
    out = sample(logits(3), [row(plain), row(forced), row(plain)])
    assert out.token_ids == [FAVOURITE, 17, FAVOURITE]


def test_logprobs_are_those_of_the_biased_logits():
    params = biased({17: 100.0}, num_logprobs=1)
    out = sample(logits(), [row(params)])
    assert out.top_token_ids == [[17]] and out.logprobs[0] == pytest.approx(0.0, abs=1e-4)


def test_the_codec_carries_the_columns():
    message = step_pb2.SamplingParams(logit_bias_token_ids=[3, 9], logit_bias_values=[1.0, -100])
    params = decode_sampling(message)
    assert (params.logit_bias_token_ids, params.logit_bias_values) == ((3, 9), (1.0, -100.0))


@pytest.mark.parametrize(
    ("bias", "phrase"),
    [
        (SamplingParams(logit_bias_token_ids=(3, VOCAB), logit_bias_values=(1.0, 1.0)), "out of range"),
        (SamplingParams(logit_bias_token_ids=(3, 3), logit_bias_values=(1.0, 1.0)), "twice"),
        (SamplingParams(logit_bias_token_ids=(3,), logit_bias_values=()), "1 token ids for 0"),
    ],
)  # fmt: skip
def test_the_sequence_table_refuses_malformed_columns(bias, phrase):
    table = SequenceTable(
        num_kv_blocks=8, block_size=4, vocab_size=VOCAB, max_context_tokens=64, max_logprobs=5
    )
    plan = StepPlan(
        step_id=0,
        new_sequences=[NewSequence(seq_id=1, sampling=bias, num_prompt_tokens=2)],
        seq_ids=[1],
        start_positions=[0],
        sample=[True],
        token_offsets=[0, 2],
        token_ids=[3, 4],
        block_offsets=[0, 1],
        block_ids=[0],
    )
    admitted, refusals = table.admit(plan)
    assert admitted.seq_ids == [] and 1 not in table
    assert "logit_bias" in refusals[1] and phrase in refusals[1]
