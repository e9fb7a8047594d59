"""The paged KV pool: per layer, K and V as [num_blocks, block_size, kv_heads, head_dim].

Block ids are the scheduler's; the pool only stores. Slot s (= block_id * block_size
+ offset) of a layer is row s of the flat view [num_blocks * block_size, kv_heads,
head_dim], which is what the attention writes and gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1 << 30
# Set by tensor_parallel.shard_model on a sharded model's text config: its rank holds
# num_key_value_heads / this many KV heads.
TENSOR_PARALLEL_ATTRIBUTE = "pagoda_tensor_parallel_size"


@dataclass(frozen=True, slots=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block."""
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        per_layer = self.block_size * self.num_kv_heads * self.head_dim * element_bytes
        return 2 * self.num_layers * per_layer

    @classmethod
    def from_model_config(cls, config, block_size: int, dtype: torch.dtype) -> KVGeometry:
        text = config.get_text_config()
        num_heads = text.num_attention_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        num_kv_heads //= getattr(text, TENSOR_PARALLEL_ATTRIBUTE, 1)  # this rank's share
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        return cls(text.num_hidden_layers, num_kv_heads, head_dim, block_size, dtype)


def num_blocks_for_budget(budget_bytes: float, geometry: KVGeometry) -> int:
    num_blocks = int(budget_bytes // geometry.bytes_per_block)
    if num_blocks < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes / GIB:.3f} GiB holds no block of "
            f"{geometry.bytes_per_block} bytes"
        )
    return num_blocks


class KVPool:
    """Preallocated, zero-filled (masked slots are read, and 0 * NaN would poison them)."""

    def __init__(self, geometry: KVGeometry, num_blocks: int, device: torch.device | str) -> None:
        self.geometry = geometry
        self.num_blocks = num_blocks
        shape = (num_blocks, geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
        self.key_blocks = [
            torch.zeros(shape, dtype=geometry.dtype, device=device)
            for _ in range(geometry.num_layers)
        ]
        self.value_blocks = [
            torch.zeros(shape, dtype=geometry.dtype, device=device)
            for _ in range(geometry.num_layers)
        ]
        flat = (num_blocks * geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
        self._key_slots = [k.view(flat) for k in self.key_blocks]
        self._value_slots = [v.view(flat) for v in self.value_blocks]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.geometry.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.geometry.bytes_per_block

    def layer_blocks(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V caches, [num_blocks, block_size, kv_heads, head_dim] each."""
        return self.key_blocks[layer_idx], self.value_blocks[layer_idx]

    def layer_slots(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat [num_slots, kv_heads, head_dim] views of one layer's K and V."""
        return self._key_slots[layer_idx], self._value_slots[layer_idx]
