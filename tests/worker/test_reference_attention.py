"""The reference backend's decode rows grouped by length give each row's own attention.

Grouping only changes how rows are padded into SDPA calls; every row must still see
exactly its own keys (and its window), whatever group it lands in and in whatever order
the plan put the rows.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.gpu_worker.attention.backend import AttentionMetadata
from pagoda.gpu_worker.attention.reference import ReferenceBackend, decode_groups

BLOCK_SIZE = 16
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 3, 16
# Long rows among short ones, not in length order: two groups, or three.
MIXED_LENGTHS = [40, 553, 37, 300, 1, 553, 18, 16, 17, 160]


def decode_step(lengths: list[int], seed: int = 0):
    """Decode rows of the given context lengths over random cached keys at scattered blocks;
    returns (query, key_cache, value_cache, metadata, per-row keys and values)."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = [-(-length // BLOCK_SIZE) for length in lengths]
    total_blocks = sum(num_blocks) + 1
    shape = (total_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=generator)
    value_cache = torch.randn(shape, generator=generator)
    free = (torch.randperm(total_blocks - 1, generator=generator) + 1).tolist()
    table = torch.zeros(len(lengths), max(num_blocks) + 1, dtype=torch.int32)
    rows_keys, rows_values = [], []
    for row, (length, blocks) in enumerate(zip(lengths, num_blocks, strict=True)):
        ids = [free.pop() for _ in range(blocks)]
        table[row, :blocks] = torch.tensor(ids, dtype=torch.int32)
        slots = torch.tensor(
            [ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)]
        )
        rows_keys.append(key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots])
        rows_values.append(value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots])
    query = torch.randn(len(lengths), NUM_KV_HEADS * GROUP, HEAD_DIM, generator=generator)
    context_lens = torch.tensor(lengths, dtype=torch.int32)
    starts = torch.arange(len(lengths) + 1, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_tokens=len(lengths),
        num_seqs=len(lengths),
        num_decode_seqs=len(lengths),
        max_query_len=1,
        max_context_len=max(lengths),
        max_decode_context_len=max(lengths),
        block_size=BLOCK_SIZE,
        query_start_loc=starts,
        context_lens=context_lens,
        block_table=table,
        slot_mapping=torch.zeros(len(lengths), dtype=torch.int64),
        query_start_loc_cpu=starts,
        context_lens_cpu=context_lens,
    )
    return query, key_cache, value_cache, metadata, rows_keys, rows_values


def own_attention(query, rows_keys, rows_values, scale, sliding_window=None):
    """Each row alone over exactly its keys, in float64."""
    outputs = []
    for row, (keys, values) in enumerate(zip(rows_keys, rows_values, strict=True)):
        if sliding_window is not None:
            keys, values = keys[-sliding_window:], values[-sliding_window:]
        keys = keys.double().repeat_interleave(GROUP, dim=1).transpose(0, 1)  # [heads, L, d]
        values = values.double().repeat_interleave(GROUP, dim=1).transpose(0, 1)
        scores = (query[row].double()[:, None, :] @ keys.transpose(1, 2)) * scale
        outputs.append((torch.softmax(scores, dim=-1) @ values)[:, 0, :])
    return torch.stack(outputs).float()


def test_mixed_lengths_are_split_into_groups_and_one_length_is_not():
    groups = decode_groups(MIXED_LENGTHS, BLOCK_SIZE)
    assert groups is not None and len(groups) >= 2
    assert sorted(row for group in groups for row in group) == list(range(len(MIXED_LENGTHS)))
    for group in groups:  # padding at most doubles a row's blocks
        longest = -(-MIXED_LENGTHS[group[0]] // BLOCK_SIZE)
        assert all(2 * -(-MIXED_LENGTHS[row] // BLOCK_SIZE) > longest for row in group)
    assert decode_groups([300] * 8, BLOCK_SIZE) is None
    assert decode_groups([40, 60], BLOCK_SIZE) is None  # too little to save for a call


@pytest.mark.parametrize("sliding_window", [None, 24])
@pytest.mark.parametrize("lengths", [MIXED_LENGTHS, [553] * 3, [1, 553]])
def test_grouped_decode_rows_each_see_their_own_keys(lengths, sliding_window):
    query, key_cache, value_cache, metadata, rows_keys, rows_values = decode_step(lengths)
    scale = HEAD_DIM**-0.5
    output = ReferenceBackend().forward(
        query,
        query[:, :NUM_KV_HEADS],
        query[:, :NUM_KV_HEADS],
        key_cache,
        value_cache,
        metadata,
        scale=scale,
        sliding_window=sliding_window,
    )
    expected = own_attention(query, rows_keys, rows_values, scale, sliding_window)
    torch.testing.assert_close(output, expected, rtol=1e-4, atol=1e-5)
