"""The CPU attention's rows are bit-exact whatever shares their call (attention/invariant.py):
a decode row alone, beside longer rows, as a row of a prefill, of a chunk, of a prefill long
enough to be attended in query blocks; and close to SDPA."""

from __future__ import annotations

import pytest

# (query heads, KV heads, head size): the default model's; Qwen3-0.6B's, whose q.k over 128
# dimensions an Intel Xeon multiplied with other kernels at 2-4 rows than at 16 (rows were
# then padded to a multiple of 4 only); and a head of 256.
GEOMETRIES = [(9, 3, 64), (16, 8, 128), (8, 4, 256)]


@pytest.fixture(scope="module", params=GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
def tensors(request):
    import torch

    heads, kv_heads, head_dim = request.param
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, kv_heads, 300, head_dim, generator=generator)
    values = torch.randn(1, kv_heads, 300, head_dim, generator=generator)
    queries = torch.randn(1, heads, 300, head_dim, generator=generator)
    return queries, keys, values


def scale_of(queries) -> float:
    return queries.shape[-1] ** -0.5


def test_close_to_sdpa_and_the_same_blocked_or_not(tensors, monkeypatch):
    import torch
    import torch.nn.functional as F

    from pagoda.gpu_worker.attention import invariant

    queries, keys, values = tensors
    scale = scale_of(queries)
    blocked = invariant.attend_batch_invariant(queries, keys, values, None, scale, None, True)
    expected = F.scaled_dot_product_attention(
        queries, keys, values, is_causal=True, enable_gqa=True, scale=scale
    )
    assert torch.allclose(blocked, expected, atol=1e-5)
    monkeypatch.setattr(invariant, "QUERY_BLOCK", 10**9)
    whole = invariant.attend_batch_invariant(queries, keys, values, None, scale, None, True)
    assert torch.equal(blocked, whole)


def test_a_row_is_bit_exact_as_decode_chunk_prefill_and_beside_longer_rows(tensors):
    import torch

    from pagoda.gpu_worker.attention.invariant import attend_batch_invariant as attend

    queries, keys, values = tensors
    scale = scale_of(queries)
    heads, kv_heads, head_dim = queries.shape[1], keys.shape[1], queries.shape[-1]
    prefill = attend(queries, keys, values, None, scale, None, True)
    positions = torch.arange(300)
    chunk_mask = positions[None, :] <= positions[170:, None]
    chunk = attend(queries[:, :, 170:], keys, values, chunk_mask, scale, None)
    assert torch.equal(chunk, prefill[:, :, 170:])
    for position in (0, 6, 63, 64, 200, 299):
        # A decode row: the query heads sharing a KV head are its rows (reference.py).
        row = queries[:, :, position].reshape(1, kv_heads, heads // kv_heads, head_dim)
        seen = slice(0, position + 1)
        alone = attend(row, keys[:, :, seen], values[:, :, seen], None, scale, None)
        assert torch.equal(alone.reshape(1, heads, head_dim), prefill[:, :, position])
        # Beside three longer rows, padded to the longest with a mask.
        others = torch.randn(3, kv_heads, heads // kv_heads, head_dim)
        lens = torch.tensor([position + 1, 300, 150, 299])
        mask = (positions[None, :] < lens[:, None])[:, None, None, :]
        batch_keys = torch.cat([keys, torch.randn(3, kv_heads, 300, head_dim)])
        batch_values = torch.cat([values, torch.randn(3, kv_heads, 300, head_dim)])
        batch = attend(torch.cat([row, others]), batch_keys, batch_values, mask, scale, None)
        assert torch.equal(batch[:1], alone), position
