"""Every per-row number a sampling step reads, uploaded to the device in one copy.

The sampler needs, per step, the rows' temperatures, penalties, top-k/top-p/min-p, seeded
uniforms, which rows draw, and the (row, token) pairs of the logit biases, the banned and
allowed ids and the min_new_tokens masks. Built as separate `torch.tensor(list,
device=cuda)` calls these were 5-6 blocking uploads a step, each waiting for the forward.
Here they are laid end to end in one float64 host buffer (pinned on CUDA), copied once
with non_blocking, and each column is a view of the device copy, converted to the dtype its
reader needs. float64 holds every token id and row index exactly, and converting one of
its values to float32 rounds once, as `torch.tensor(floats, dtype=torch.float32)` does,
so the sampler's results are bit-identical to building each column apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagoda.gpu_worker.sampler import SampleRow


@dataclass(slots=True)
class SamplingColumns:
    """Named runs of one device float64 tensor; `floats`/`longs` convert a run."""

    values: torch.Tensor  # [total] float64, on the sampling device
    spans: dict[str, tuple[int, int]]

    def floats(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        start, stop = self.spans[name]
        return self.values[start:stop].to(dtype)

    def longs(self, name: str) -> torch.Tensor:
        start, stop = self.spans[name]
        return self.values[start:stop].long()


def upload_columns(rows: list[SampleRow], vocab_size: int, device: torch.device) -> SamplingColumns:
    """The columns of `rows` (see the module docstring) on `device`, one copy."""
    from pagoda.gpu_worker.sampler import seeded_uniform  # the sampler imports this module

    params = [r.params for r in rows]
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    columns: dict[str, list[float] | list[int]] = {
        "temperature": [1.0 if p.is_greedy else p.temperature for p in params],
        "repetition": [p.repetition_penalty for p in params],
        "presence": [p.presence_penalty for p in params],
        "frequency": [p.frequency_penalty for p in params],
        "sampled_rows": sampled,
        # top-k limit per drawing row: the vocabulary when it has none
        "top_k": [
            k if (k := min(params[i].top_k, vocab_size)) > 0 else vocab_size for i in sampled
        ],
        "top_p": [params[i].top_p for i in sampled],
        "min_p": [params[i].min_p for i in sampled],
        "uniform": [seeded_uniform(params[i].seed, rows[i].position) for i in sampled],
    }
    _add_pairs(columns, "bias", {i: p.logit_bias_token_ids for i, p in enumerate(params)})
    columns["bias_values"] = [
        v for p in params if p.logit_bias_token_ids for v in p.logit_bias_values
    ]
    _add_pairs(columns, "banned", {i: p.banned_token_ids for i, p in enumerate(params)})
    limited = [i for i, p in enumerate(params) if p.allowed_token_ids]
    columns["allowed_limited"] = limited
    _add_pairs(columns, "allowed", {k: params[i].allowed_token_ids for k, i in enumerate(limited)})
    min_tokens = {
        i: r.min_tokens_banned_ids
        for i, r in enumerate(rows)
        if r.position - r.num_prompt_tokens < r.min_new_tokens
    }
    _add_pairs(columns, "min_tokens", min_tokens)
    columns["masked_rows"] = [i for i, r in enumerate(rows) if r.allowed_token_mask is not None]
    spans: dict[str, tuple[int, int]] = {}
    flat: list[float] = []
    for name, column in columns.items():
        spans[name] = (len(flat), len(flat) + len(column))
        flat.extend(column)
    host = torch.tensor(flat, dtype=torch.float64)
    if device.type == "cuda":
        host = host.pin_memory()
    return SamplingColumns(host.to(device, non_blocking=True), spans)


def _add_pairs(columns: dict, name: str, token_ids: dict) -> None:
    """`name`_rows and `name`_tokens: one (row, token) pair per id of token_ids[row]."""
    columns[f"{name}_rows"] = [row for row, ids in token_ids.items() for _ in ids]
    columns[f"{name}_tokens"] = [t for ids in token_ids.values() for t in ids]
