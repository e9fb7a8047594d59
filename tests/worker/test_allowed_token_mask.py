"""The structured-output mask on the worker (issue 28 item 3): a constrained row samples
only tokens its bitmask allows, greedy and seeded, after the logit bias; rows without a
mask in the same batch are untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.common.dummy_tokens import OutsideMask, dummy_next_token
from pagoda.common.step import SamplingParams
from pagoda.gpu_worker.sampler import SampleRow, mask_disallowed_tokens, sample

VOCAB = 70  # three words a row, the last one partly past the vocabulary


def bitmask(allowed: set[int]) -> bytes:
    bits = np.zeros(96, dtype=np.uint8)
    bits[list(allowed)] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def logits(num_rows: int) -> torch.Tensor:
    return torch.linspace(-2.0, 5.0, VOCAB).repeat(num_rows, 1)  # the last id is the argmax


def row(params: SamplingParams, mask: bytes | None, position: int = 4) -> SampleRow:
    return SampleRow(params, [1, 2, 3, 4][:position], 2, position, mask)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.5, seed=3)])
def test_a_constrained_row_samples_only_allowed_tokens(params):
    allowed = {0, 31, 32, 64}
    for position in range(4, 30):
        out = sample(logits(1), [row(params, bitmask(allowed), position)])
        assert out.token_ids[0] in allowed
    assert sample(logits(1), [row(SamplingParams(), bitmask(allowed))]).token_ids == [64]


def test_only_constrained_rows_are_masked():
    rows = [
        row(SamplingParams(), None),
        row(SamplingParams(), bitmask({5})),
        row(SamplingParams(), None),
    ]
    masked = mask_disallowed_tokens(logits(3), rows)
    assert torch.equal(masked[0], logits(1)[0]) and torch.equal(masked[2], logits(1)[0])
    assert torch.isfinite(masked[1]).tolist() == [t == 5 for t in range(VOCAB)]
    assert sample(logits(3), rows).token_ids == [VOCAB - 1, 5, VOCAB - 1]


def test_the_mask_wins_over_a_logit_bias():
    params = SamplingParams(logit_bias_token_ids=(7,), logit_bias_values=(100.0,))
    assert sample(logits(1), [row(params, bitmask({8, 9}))]).token_ids == [9]


def test_the_dummy_worker_takes_the_next_allowed_id():
    free = dummy_next_token(3, 4, VOCAB)
    assert dummy_next_token(3, 4, VOCAB, OutsideMask(bitmask({free}))) == free
    allowed = (free + 5) % VOCAB
    assert dummy_next_token(3, 4, VOCAB, OutsideMask(bitmask({allowed}))) == allowed


def test_the_masked_logits_are_masked_fills_floats_exactly():
    """The CPU adds each mask byte's 0 or -inf from a table instead of a masked_fill:
    the same floats, bit for bit, on any rows of a batch (the vocabulary ends inside a word)."""
    generator = torch.Generator().manual_seed(0)
    batch = torch.randn(5, VOCAB, generator=generator) * 10
    batch[0, 3] = float("-inf")  # a logit bias's -inf stays -inf
    masks = {1: set(range(0, VOCAB, 3)), 2: {69}, 4: set(range(VOCAB)) - {0, 40}}
    rows = [row(SamplingParams(), bitmask(masks[i]) if i in masks else None) for i in range(5)]
    expected = batch.clone()
    for i, allowed in masks.items():
        expected[i] = expected[i].masked_fill(
            torch.tensor([t not in allowed for t in range(VOCAB)]), float("-inf")
        )
    assert torch.equal(mask_disallowed_tokens(batch.clone(), rows), expected)
