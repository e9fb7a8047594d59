"""The `cpu` paged-attention backend: one call of Pagoda's C kernel per layer for the whole
step (gpu_worker/kernels/paged_attention.c), reading keys and values through the block
table where they lie; `auto`'s choice on a CPU where the kernels build.

The reference backend gathers each row's blocks into new tensors, pads them, and runs a
dozen torch ops per group of rows; on a CPU those copies and calls were most of a decode
step's attention (profiled at batch 32: the gathers and their copies alone took about a
third of the step). Here each (row, head) is one loop over its keys in position order,
so the result is batch-invariant by construction and float32 throughout; it differs from
the reference only in the order of its sums (tests compare the two).

The step's new keys and values go into their slots by the kernels' `write_kv`, a plain
copy per row (torch's index_copy_ took twice as long: 1.85 against 0.85 ms a decode step
at batch 64).

A float32 cache whose head size is a multiple of 8 runs on the kernel; anything else
(another cache dtype, an odd head size, kernels that cannot be built here) on the
reference backend, whose result this one must match.
"""

from __future__ import annotations

import torch

from pagoda.gpu_worker import cpu_kernels
from pagoda.gpu_worker.attention.backend import AttentionMetadata
from pagoda.gpu_worker.attention.reference import ReferenceBackend


class CpuBackend:
    name = "cpu"

    def __init__(self) -> None:
        self._kernels = cpu_kernels.load()
        self._reference = ReferenceBackend()

    @property
    def uses_kernel(self) -> bool:
        return self._kernels is not None

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        if self._takes(key, key_cache, value_cache) and self._takes(value, key_cache, value_cache):
            self._kernels.write_kv(key, value, metadata.slot_mapping, key_cache, value_cache)
        else:
            self._reference.write_kv(key, value, key_cache, value_cache, metadata)

    def _takes(
        self, rows: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> bool:
        """Whether the kernel's write takes `rows` [T, kv_heads, d] into these caches: all
        float32, each row's kv_heads * d floats contiguous, the caches contiguous."""
        return (
            self._kernels is not None
            and rows.dtype == key_cache.dtype == value_cache.dtype == torch.float32
            and rows.stride(2) == 1
            and rows.stride(1) == rows.shape[2]
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
            and rows.shape[1:] == key_cache.shape[2:]
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        kernels = self._kernels
        if (
            kernels is None
            or query.dtype != torch.float32
            or key_cache.dtype != torch.float32
            or query.shape[-1] % 8
            or not key_cache.is_contiguous()
            or not value_cache.is_contiguous()
        ):
            return self._reference.forward(
                query,
                key,
                value,
                key_cache,
                value_cache,
                metadata,
                scale=scale,
                sliding_window=sliding_window,
                softcap=softcap,
            )
        return kernels.paged_attention(
            query,
            key_cache,
            value_cache,
            metadata.block_table,
            metadata.query_start_loc,
            metadata.context_lens,
            metadata.max_context_len,
            scale,
            softcap,
            sliding_window,
        )
