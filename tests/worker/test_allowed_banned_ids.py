"""allowed_token_ids / banned_token_ids on the worker (issue 28 item 5): a row samples only
allowed ids and never a banned one, greedy and sampled; a row without either is untouched
by a limited neighbour; ids outside the vocabulary are refused; and a request validated
from the public API generates, on a tiny model, only the ids it allowed."""

from __future__ import annotations

import pytest
import torch

from pagoda.common.step import NewSequence, SamplingParams, StepPlan
from pagoda.common.step_codec import encode_sampling
from pagoda.gpu_worker.sampler import SampleRow, mask_allowed_and_banned, sample
from pagoda.gpu_worker.sequence_table import SequenceTable
from pagoda.protos import generation_pb2 as pb
from pagoda.scheduler_svc.validation import Limits, validate_generate
from tests.worker.conftest import TEST_BLOCK_SIZE, TEST_NUM_BLOCKS, random_prompts
from tests.worker.toy_scheduler import ToyScheduler

VOCAB = 32
FAVOURITE = 5  # the argmax of the test logits by far


def logits(num_rows: int = 1) -> torch.Tensor:
    values = torch.linspace(-3.0, 3.0, VOCAB).repeat(num_rows, 1)
    values[:, FAVOURITE] = 12.0
    return values


def row(params: SamplingParams, position: int = 3) -> SampleRow:
    return SampleRow(params, [1, 2, 3][:position], 2, position)


KNOBS = [{}, {"temperature": 1.0, "seed": 4}, {"temperature": 0.8, "top_k": 4, "seed": 9}]


def test_the_mask_is_minus_infinity_outside_allowed_and_on_banned():
    params = SamplingParams(allowed_token_ids=(1, 5, 9), banned_token_ids=(5, 20))
    masked = mask_allowed_and_banned(logits(), [row(params)])[0]
    assert torch.isfinite(masked).nonzero().flatten().tolist() == [1, 9]
    assert masked[9] == logits()[0, 9]  # kept values are not shifted


@pytest.mark.parametrize("knobs", KNOBS)
def test_only_allowed_ids_are_sampled(knobs):
    allowed = (0, 7, 30)
    for position in range(3, 40):  # seeded draws at many positions
        params = SamplingParams(allowed_token_ids=allowed, **knobs)
        assert sample(logits(), [row(params, position)]).token_ids[0] in allowed


@pytest.mark.parametrize("knobs", KNOBS)
def test_a_banned_id_is_never_sampled(knobs):
    assert sample(logits(), [row(SamplingParams(**knobs))]).token_ids == [FAVOURITE]
    for position in range(3, 40):
        params = SamplingParams(banned_token_ids=(FAVOURITE,), **knobs)
        assert sample(logits(), [row(params, position)]).token_ids[0] != FAVOURITE


def test_only_the_limited_rows_change():
    plain = SamplingParams()
    allowed, banned = SamplingParams(allowed_token_ids=(17,)), SamplingParams(banned_token_ids=(5,))
    out = sample(logits(4), [row(plain), row(allowed), row(plain), row(banned)])
    assert out.token_ids == [FAVOURITE, 17, FAVOURITE, 31]  # 31: the best after the favourite


@pytest.mark.parametrize("field", ["allowed_token_ids", "banned_token_ids"])
def test_the_sequence_table_refuses_an_id_outside_the_vocabulary(field):
    table = SequenceTable(
        num_kv_blocks=8, block_size=4, vocab_size=VOCAB, max_context_tokens=64, max_logprobs=5
    )
    sampling = SamplingParams(**{field: (3, VOCAB)})
    plan = StepPlan(
        step_id=0,
        new_sequences=[NewSequence(seq_id=1, sampling=sampling, num_prompt_tokens=2)],
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
    assert field in refusals[1] and "out of range" in refusals[1]


def test_greedy_output_on_a_tiny_model_uses_only_the_allowed_ids(llama_models):
    """From the public request through validation, the step codec, the sequence table and
    the sampler of a paged engine: the model's own greedy choices are not allowed, so the
    output differs from them and holds allowed ids only."""
    num_new_tokens = 8
    vocab_size = llama_models.reference.config.vocab_size
    limits = Limits(
        max_context_tokens=256,
        vocab_size=vocab_size,
        default_max_new_tokens=num_new_tokens,
        max_stop_strings=4,
        max_stop_string_bytes=8,
        max_logprobs=5,
    )
    for seq_id, prompt in enumerate(random_prompts(2, seed=31)):
        unlimited = llama_models.greedy(prompt, num_new_tokens)
        allowed = sorted(set(range(3, 200, 7)) - set(unlimited))
        request = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(allowed_token_ids=allowed),
        )
        sampling = validate_generate(request, None, limits).sampling
        scheduler = ToyScheduler(
            llama_models.engine(), num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE
        )
        scheduler.add(seq_id, prompt, sampling=encode_sampling(sampling))
        ours = scheduler.run(num_new_tokens)[seq_id]
        assert len(ours) == num_new_tokens and set(ours) <= set(allowed)
