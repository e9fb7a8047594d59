"""What every paged-attention backend is given and must do.

One step's tokens are packed as one sequence of T rows. Row order: the one-token chunks
(decode) first, one row per sequence, then the multi-token chunks (prefill), each a
contiguous run of rows. Sequence i of the step owns rows
[query_start_loc[i], query_start_loc[i + 1]) at positions
[context_lens[i] - query_len_i, context_lens[i]); its keys are the positions
[0, context_lens[i]) of its block table (this step's included: `write_kv` runs first).

`AttentionMetadata` is built once per step by the engine and passed explicitly to every
layer's attention through the model's forward kwargs (never through a module global), so
a backend's forward can be compiled or captured. Its fields are tensors on the worker's
device plus plain ints; the two `*_cpu` tensors are host copies of the same values for
backends that loop on the host (the reference does; a kernel should not need them).

The KV cache of a layer is two tensors [num_blocks, block_size, kv_heads, head_dim]
(pagoda.gpu_worker.kv_pool); slot s is block s // block_size, offset s % block_size.

Semantics every backend must match (the reference backend is the definition):
- causal: the query at position p sees keys at positions j <= p of its own sequence;
- sliding window w (when given): only keys with p - w < j <= p (Hugging Face's meaning);
- softcap c (when given): scores = c * tanh(scores / c), after scaling, before masking;
- grouped-query attention: query head h reads KV head h // (heads // kv_heads);
- scale multiplies q.k (None never reaches a backend: the caller resolves it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One step's attention inputs: tensors on the worker's device plus ints.

    num_seqs sequences, num_tokens packed rows, num_decode_seqs of them (the first ones,
    rows [0, num_decode_seqs)) feeding exactly one token.
    """

    num_tokens: int
    num_seqs: int
    num_decode_seqs: int
    max_query_len: int  # longest chunk of the step (1 when all decode)
    max_context_len: int  # max(context_lens)
    max_decode_context_len: int  # max(context_lens[:num_decode_seqs]); 0 without decode rows
    block_size: int
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cumulative query lengths, [0] = 0
    context_lens: torch.Tensor  # int32 [num_seqs]: keys per sequence, after this step's write
    block_table: torch.Tensor  # int32 [num_seqs, W]: W >= ceil(max_context_len / block_size)
    # (rows padded with block 0 past a sequence's blocks; never read by a correct backend)
    slot_mapping: torch.Tensor  # int64 [num_tokens]: flat slot each row's K/V is written to
    query_start_loc_cpu: torch.Tensor  # int32 [num_seqs + 1], on the host
    context_lens_cpu: torch.Tensor  # int32 [num_seqs], on the host

    @property
    def num_prefill_seqs(self) -> int:
        return self.num_seqs - self.num_decode_seqs


class AttentionBackend(Protocol):
    """A paged-attention implementation. One instance per engine; stateless across steps
    except for caches it may keep keyed by the metadata object of the current step."""

    name: str

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """Store row t's key/value at slot metadata.slot_mapping[t] (cast to the cache dtype)."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, heads, head_dim]
        key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]: this step's, already written
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of every row over its sequence's cached keys -> [num_tokens, heads, head_dim]
        in query's dtype. Called after write_kv for the same layer and step."""
