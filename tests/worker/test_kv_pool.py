"""KV pool sizing from a memory budget, and its layout."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pagoda.gpu_worker.kv_pool import GIB, KVGeometry, KVPool, num_blocks_for_budget


def test_geometry_comes_from_the_model_config_and_sizes_the_pool():
    config = LlamaConfig(
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576
    )
    geometry = KVGeometry.from_model_config(config, block_size=16, dtype=torch.float32)
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) == (30, 3, 64)
    # K and V, 30 layers, 16 tokens x 3 heads x 64 dims x 4 bytes.
    assert geometry.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 4
    assert num_blocks_for_budget(1 * GIB, geometry) == GIB // geometry.bytes_per_block == 1456
    half = KVGeometry(30, 3, 64, 16, torch.bfloat16)
    assert num_blocks_for_budget(1 * GIB, half) == 2912  # half the bytes, twice the blocks


def test_a_budget_below_one_block_is_refused_with_a_sentence():
    geometry = KVGeometry(2, 2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="holds no block of 4096 bytes"):
        num_blocks_for_budget(1000, geometry)


def test_pool_layout_and_flat_slot_views_share_storage():
    geometry = KVGeometry(2, 2, 8, 4, torch.float32)
    pool = KVPool(geometry, num_blocks=5, device="cpu")
    assert pool.key_blocks[0].shape == (5, 4, 2, 8) and pool.num_slots == 20
    assert pool.num_bytes == 5 * geometry.bytes_per_block
    keys, _ = pool.layer_slots(1)
    keys[4 * 3 + 2] = 1.0  # block 3, offset 2
    assert pool.key_blocks[1][3, 2].eq(1.0).all() and pool.key_blocks[0].eq(0).all()
