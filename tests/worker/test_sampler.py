"""The batched sampler against its definitions (and transformers' own logits processors)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagoda.common.step import SamplingParams
from pagoda.gpu_worker.sampler import SampleRow, apply_penalties, sample, seeded_uniform

VOCAB = 64


def row(history=(1, 2, 3), num_prompt_tokens=None, position=None, **params) -> SampleRow:
    history = list(history)
    return SampleRow(
        SamplingParams(**params),
        history,
        len(history) if num_prompt_tokens is None else num_prompt_tokens,
        len(history) if position is None else position,
    )


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = random_logits(5)
    out = sample(logits, [row() for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == []


def test_top_k_one_is_greedy_whatever_the_seed():
    logits = random_logits(4, seed=1)
    rows = [row(temperature=1.3, top_k=1, seed=s) for s in range(4)]
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_repetition_penalty_matches_transformers():
    logits = random_logits(2, seed=2)
    history = [[3, 5, 5, 9, 20], [1, 4, 63]]
    rows = [row(h, repetition_penalty=1.7) for h in history]
    ours = apply_penalties(logits.clone(), rows)
    for i, h in enumerate(history):
        theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([h]), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], theirs)
    # Positive logits shrink, negative ones grow more negative, unseen tokens stay.
    seen = set(history[0])
    for token in range(VOCAB):
        before, after = logits[0, token].item(), ours[0, token].item()
        if token not in seen:
            assert after == before
        elif before > 0:
            assert after == pytest.approx(before / 1.7)
        else:
            assert after == pytest.approx(before * 1.7)


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.zeros(1, VOCAB)
    # Prompt [7, 7, 8]; generated [8, 9, 9, 9].
    rows = [
        row(
            [7, 7, 8, 8, 9, 9, 9], num_prompt_tokens=3, presence_penalty=0.5, frequency_penalty=0.25
        )
    ]
    out = apply_penalties(logits, rows)[0]
    assert out[7].item() == 0.0  # prompt only
    assert out[8].item() == pytest.approx(-(0.5 + 0.25 * 1))
    assert out[9].item() == pytest.approx(-(0.5 + 0.25 * 3))
    assert out[10].item() == 0.0


def test_rows_without_penalties_are_untouched_in_a_penalized_batch():
    logits = random_logits(2, seed=3)
    rows = [row([1, 2], repetition_penalty=2.0, presence_penalty=1.0), row([1, 2])]
    out = apply_penalties(logits.clone(), rows)
    torch.testing.assert_close(out[1], logits[1])
    assert not torch.equal(out[0], logits[0])


def test_logprobs_are_a_distribution_after_temperature():
    logits = random_logits(3, seed=4)
    rows = [
        row(temperature=0.0, num_logprobs=VOCAB),
        row(temperature=0.7, seed=1, num_logprobs=VOCAB),
        row(temperature=1.5, seed=2, top_k=3, num_logprobs=5),
    ]
    out = sample(logits, rows)
    assert [len(ids) for ids in out.top_token_ids] == [VOCAB, VOCAB, 5]
    for i in range(2):
        assert math.fsum(math.exp(lp) for lp in out.top_logprobs[i]) == pytest.approx(1.0)
    for i, temperature in enumerate([1.0, 0.7, 1.5]):
        expected = torch.log_softmax(logits[i] / temperature, -1)
        assert out.logprobs[i] == pytest.approx(expected[out.token_ids[i]].item(), abs=1e-5)
        assert out.top_logprobs[i] == sorted(out.top_logprobs[i], reverse=True)
        assert out.top_token_ids[i][0] == logits[i].argmax().item()


def _support(logits_row: torch.Tensor, params: dict, num_draws: int = 300) -> set[int]:
    rows = [row(seed=s, temperature=1.0, **params) for s in range(num_draws)]
    return set(sample(logits_row.expand(num_draws, -1).clone(), rows).token_ids)


def test_top_k_and_top_p_draw_only_inside_transformers_support():
    logits = random_logits(1, seed=5)
    scores = logits.clone()
    top_k_allowed = set(
        torch.nonzero(TopKLogitsWarper(5)(None, scores.clone())[0] > -math.inf)[:, 0].tolist()
    )
    top_p_allowed = set(
        torch.nonzero(TopPLogitsWarper(0.6)(None, scores.clone())[0] > -math.inf)[:, 0].tolist()
    )
    assert _support(logits, {"top_k": 5}) <= top_k_allowed
    assert _support(logits, {"top_p": 0.6}) <= top_p_allowed
    assert len(_support(logits, {"top_k": 5})) > 1


def test_min_p_removes_unlikely_tokens():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, :3] = torch.tensor([2.0, 1.5, -1.0])  # probs ~0.6, 0.37, 0.03
    drawn = _support(logits, {"min_p": 0.1})
    assert drawn == {0, 1}


def test_draw_depends_only_on_seed_and_position():
    logits = random_logits(1, seed=6)
    alone = sample(logits.clone(), [row(temperature=1.0, seed=42, position=17)]).token_ids[0]
    batch = random_logits(8, seed=7)
    batch[5] = logits[0]
    rows = [row(temperature=1.0, seed=s, position=3) for s in range(8)]
    rows[5] = row(temperature=1.0, seed=42, position=17)
    assert sample(batch, rows).token_ids[5] == alone
    assert seeded_uniform(42, 17) != seeded_uniform(42, 18) != seeded_uniform(43, 17)


def test_seeded_draw_ignores_the_filters_of_its_neighbours():
    """A temperature-only row draws the same token alone and beside rows whose top-k or
    top-p make the batch rank its candidates."""
    logits = random_logits(1, seed=8)
    for seed in range(40):
        plain = row(temperature=0.8, seed=seed, position=5)
        alone = sample(logits.clone(), [plain]).token_ids[0]
        for neighbour in ({"top_k": 3}, {"top_p": 0.5}, {"top_k": 10, "top_p": 0.9}):
            batch = torch.cat([random_logits(1, seed=9), logits])
            rows = [row(temperature=1.0, seed=7, **neighbour), plain]
            assert sample(batch, rows).token_ids[1] == alone, (seed, neighbour)


def test_seeded_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log()[None, :]
    num_draws = 3000
    rows = [row(temperature=1.0, seed=s) for s in range(num_draws)]
    counts = Counter(sample(logits.expand(num_draws, -1).clone(), rows).token_ids)
    for token, p in enumerate(probs.tolist()):
        assert counts[token] / num_draws == pytest.approx(p, abs=0.04)


def test_draw_never_picks_a_zero_probability_entry_under_scan_error(monkeypatch):
    """A parallel scan (CUDA) may let the cdf rise by an ulp over a zero-probability entry
    (review gpu_path.md 1.4); a draw landing in that sliver must move to a live token."""
    from pagoda.gpu_worker import sampler

    probs = torch.tensor([[0.5, 0.0, 0.0, 0.5], [0.25, 0.25, 0.5, 0.0]])
    real_cumsum = torch.Tensor.cumsum

    def scan_with_error(self, *args, **kwargs):
        cdf = real_cumsum(self, *args, **kwargs)
        # Two ulps of 0.5 over every zero entry, as an unlucky parallel scan could add.
        return cdf + real_cumsum((self == 0).to(cdf.dtype), -1) * 2.4e-7

    monkeypatch.setattr(torch.Tensor, "cumsum", scan_with_error)
    # u * total falls inside the first row's sliver over entry 1; the second row's u
    # past its last live entry's cdf lands on the trailing zero.
    uniforms = torch.tensor([0.5 + 1.2e-7, 1.0 - 1e-9], dtype=torch.float64)  # as uploaded
    picked = sampler._draw(probs, uniforms).tolist()
    assert probs[0, picked[0]] > 0 and probs[1, picked[1]] > 0
    assert picked == [3, 2]
