"""The sampler's per-row numbers in one upload (gpu_worker/sampling_columns.py): the same
results, bit for bit, as one tensor per column built the way the sampler built them
before (torch.tensor of the Python values in the reader's dtype), for a seeded mix of
greedy, temperature, top-p/top-k/min-p, penalties, logit_bias, allowed/banned ids,
min_new_tokens and structured-output masks, with logprobs."""

from __future__ import annotations

import random

import torch

from pagoda.common.step import SamplingParams
from pagoda.gpu_worker import sampler
from pagoda.gpu_worker.sampler import SampleRow, sample, seeded_uniform
from pagoda.gpu_worker.sampling_columns import SamplingColumns, upload_columns

VOCAB = 97


def mixed_rows(seed: int, num_rows: int = 24) -> list[SampleRow]:
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        kind = i % 8
        params: dict = {"seed": rng.randrange(1 << 40), "num_logprobs": rng.choice([0, 0, 3])}
        if kind:
            params["temperature"] = rng.choice([0.3, 0.7, 1.0, 1.7])
        if kind in (2, 7):
            params["top_p"] = rng.choice([0.5, 0.9, 0.95])
        if kind in (3, 7):
            params["top_k"] = rng.choice([1, 5, 40, 500])
        if kind == 4:
            params["min_p"] = rng.choice([0.05, 0.2])
        if kind in (0, 5):
            params["repetition_penalty"] = rng.choice([0.8, 1.3])
            params["presence_penalty"] = rng.choice([0.0, 0.5])
            params["frequency_penalty"] = rng.choice([0.0, 0.3])
        if kind == 6:
            ids = sorted(rng.sample(range(VOCAB), 4))
            params["logit_bias_token_ids"] = tuple(ids)
            params["logit_bias_values"] = tuple(rng.uniform(-5, 5) for _ in ids)
            params["banned_token_ids"] = (ids[0] + 1,) if ids[0] + 1 not in ids else ()
        if i % 5 == 1:
            params["allowed_token_ids"] = tuple(sorted(rng.sample(range(VOCAB), 7)))
        history = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))]
        mask = None
        if i % 7 == 3:
            words = [rng.getrandbits(32) | 1 for _ in range(-(-VOCAB // 32))]
            mask = b"".join(w.to_bytes(4, "little") for w in words)
        rows.append(
            SampleRow(
                SamplingParams(**params),
                history,
                num_prompt_tokens=max(1, len(history) - 4),
                position=len(history),
                allowed_token_mask=mask,
                min_new_tokens=6 if i % 6 == 2 else 0,
                min_tokens_banned_ids=(2, 5) if i % 6 == 2 else (),
            )
        )
    return rows


def column_by_column(rows: list[SampleRow], vocab_size: int, device) -> SamplingColumns:
    """What the sampler uploaded before: each column its own tensor, in its reader's dtype
    (float32 from the Python floats, int64 indices), laid into SamplingColumns' shape."""
    columns = upload_columns(rows, vocab_size, device)
    params = [r.params for r in rows]
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    floats = {
        "temperature": [1.0 if p.is_greedy else p.temperature for p in params],
        "repetition": [p.repetition_penalty for p in params],
        "presence": [p.presence_penalty for p in params],
        "frequency": [p.frequency_penalty for p in params],
        "top_p": [params[i].top_p for i in sampled],
        "min_p": [params[i].min_p for i in sampled],
        "uniform": [seeded_uniform(params[i].seed, rows[i].position) for i in sampled],
        "bias_values": [v for p in params for v in p.logit_bias_values],
    }
    by_name = {name: torch.tensor(v, dtype=torch.float32) for name, v in floats.items()}

    class Old(SamplingColumns):
        def floats(self, name, dtype=torch.float32):
            if name in by_name:
                return by_name[name].to(dtype)
            return SamplingColumns.floats(self, name, dtype)

    return Old(columns.values, columns.spans)


def test_one_upload_samples_bit_identically_to_column_by_column(monkeypatch):
    rows = mixed_rows(seed=5)
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(5)) * 4
    new = sample(logits.clone(), rows)
    monkeypatch.setattr(sampler, "upload_columns", column_by_column)
    old = sample(logits.clone(), rows)
    assert new.token_ids == old.token_ids
    assert new.logprobs == old.logprobs  # exact float equality
    assert new.top_token_ids == old.top_token_ids
    assert new.top_logprobs == old.top_logprobs
    assert any(r.params.is_greedy for r in rows) and any(new.logprobs)


def test_columns_hold_every_row_number_exactly():
    rows = mixed_rows(seed=9)
    columns = upload_columns(rows, VOCAB, torch.device("cpu"))
    params = [r.params for r in rows]
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    assert columns.longs("sampled_rows").tolist() == sampled
    expected_top_k = [min(params[i].top_k, VOCAB) or VOCAB for i in sampled]
    assert columns.longs("top_k").tolist() == expected_top_k
    uniforms = [seeded_uniform(params[i].seed, rows[i].position) for i in sampled]
    assert columns.floats("uniform").tolist() == torch.tensor(uniforms).tolist()
    bias_rows = [i for i, p in enumerate(params) for _ in p.logit_bias_token_ids]
    assert columns.longs("bias_rows").tolist() == bias_rows
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids]
    assert columns.longs("allowed_limited").tolist() == allowed
    masked = [i for i, r in enumerate(rows) if r.allowed_token_mask is not None]
    assert columns.longs("masked_rows").tolist() == masked


def test_one_host_to_device_copy_per_sample(monkeypatch):
    """The columns cross in one tensor.to(device): counted on the CPU by the float64
    tensors that sampling builds from Python lists (one, the columns)."""
    rows = mixed_rows(seed=3)
    built = []
    real_tensor = torch.tensor

    def counting_tensor(data, *args, **kwargs):
        result = real_tensor(data, *args, **kwargs)
        if isinstance(data, list):
            built.append(result.dtype)
        return result

    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(3))
    counts = sampler.counts_from_histories(rows, VOCAB, "cpu")  # as the engine passes them
    monkeypatch.setattr(torch, "tensor", counting_tensor)
    sample(logits, rows, counts)
    assert built == [torch.float64], built
