"""Paged attention plugged into transformers' model code through its AttentionInterface.

Each attention layer of the model calls `paged_attention_forward` with q/k/v after
RoPE, shaped [1, heads, T, head_dim] for the whole packed step. The step's inputs
arrive as the model forward's extra keyword arguments, which transformers hands down
to every layer's attention: `attention_metadata` (the step's AttentionMetadata),
`kv_pool` and `attention_backend`. The backend writes all T new keys/values into
their pool slots before any read (so a sequence may attend to blocks another
sequence of the same step writes: identical prompts admitted together share blocks),
then attends.
"""

from __future__ import annotations

import torch

from pagoda.gpu_worker.attention.backend import AttentionBackend, AttentionMetadata
from pagoda.gpu_worker.kv_pool import KVPool

ATTENTION_NAME = "pagoda_paged"


def register() -> None:
    """Make ATTENTION_NAME a valid `attn_implementation` (idempotent).

    No mask function is registered for it: transformers then builds no mask at all
    (its early exit for custom attention), where a registered one that returns None
    would still cost a packed-sequence check per forward, a host sync on CUDA.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def number_attention_layers(model: torch.nn.Module) -> int:
    """Give every self-attention module a `layer_idx` (some architectures leave it None).

    Returns the number of attention modules, in forward order.
    """
    modules = [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")
    ]
    for index, module in enumerate(modules):
        if module.layer_idx is None:
            module.layer_idx = index
    return len(modules)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    attention_metadata: AttentionMetadata | None = None,
    kv_pool: KVPool | None = None,
    attention_backend: AttentionBackend | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """q [1, heads, T, d], k/v [1, kv_heads, T, d] -> ([1, T, heads, d], None)."""
    if attention_metadata is None or kv_pool is None or attention_backend is None:
        raise RuntimeError("paged attention called outside an engine step")
    key_cache, value_cache = kv_pool.layer_blocks(module.layer_idx)
    head_dim = query.shape[-1]
    if key_cache.shape[2:] != key.shape[1:2] + key.shape[3:]:
        raise RuntimeError(
            f"layer {module.layer_idx} has {key.shape[1]}x{head_dim} K/V heads; "
            f"the pool was sized for {tuple(key_cache.shape[2:])}"
        )
    queries = query[0].transpose(0, 1)  # [T, heads, d]
    keys = key[0].transpose(0, 1)  # [T, kv_heads, d]
    values = value[0].transpose(0, 1)
    attention_backend.write_kv(keys, values, key_cache, value_cache, attention_metadata)
    output = attention_backend.forward(
        queries,
        keys,
        values,
        key_cache,
        value_cache,
        attention_metadata,
        scale=head_dim**-0.5 if scaling is None else scaling,
        sliding_window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
    )
    return output[None], None
