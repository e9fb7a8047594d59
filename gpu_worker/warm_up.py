"""Compile every Triton variant a step can launch at load, not inside a step.

The triton attention kernel specialises on the query tile (decode-sized, or 64 rows when a
chunk is longer) and on the split-KV segment count, which only the batch size of a
decode-only step sets (attention/triton_paged.py); the fused dense kernels
(fused_ops.py) on each norm's width and on whether it adds a residual. Each new variant
compiles for 1-3 s the first time it is launched. `warm_up(engine)` runs, before the
worker says hello, one throwaway step per variant: a decode-only step for the smallest
batch of each segment count, and a prefill chunk; every layer's own options (sliding
window, softcap) and every fused kernel come with the forward. Its steps feed one-token or
one-chunk sequences at position 0 on blocks no sequence holds yet (none exists at load)
and forget them, so the engine is left as it was.

The plans are built by a pure function (`warm_up_plans`), tested on the CPU; the engine
runs them only on CUDA with the triton backend (the reference backend compiles nothing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pagoda.common.step import NewSequence, SamplingParams, StepPlan

log = logging.getLogger("pagoda.worker.warm_up")

PREFILL_CHUNK_TOKENS = 64  # longer than any decode-sized query tile (16 matrix rows)


def decode_batch_sizes(segments_for: Callable[[int], int], max_num_seqs: int) -> list[int]:
    """The smallest batch size, up to `max_num_seqs`, of each split-KV segment count that
    `segments_for(num_seqs)` gives (it never grows with the batch), ascending."""
    sizes: list[int] = []
    previous = None
    for num_seqs in range(1, max_num_seqs + 1):
        segments = segments_for(num_seqs)
        if segments != previous:
            sizes.append(num_seqs)
            previous = segments
        if segments == 1:
            break
    return sizes


def warm_up_plans(
    decode_sizes: list[int], prefill_tokens: int, block_size: int, num_kv_blocks: int
) -> list[StepPlan]:
    """One decode-only step per size in `decode_sizes` (sequences of one token each) and
    one step of a `prefill_tokens`-token chunk; a step that needs more than
    `num_kv_blocks` blocks is left out. Each plan forgets its sequences."""
    plans = []
    for lengths in [[1] * n for n in decode_sizes] + [[prefill_tokens]]:
        if sum(-(-length // block_size) for length in lengths) <= num_kv_blocks:
            plans.append(_plan(len(plans), lengths, block_size))
    return plans


def _plan(step_id: int, lengths: list[int], block_size: int) -> StepPlan:
    plan = StepPlan(step_id=step_id, token_offsets=[0], block_offsets=[0])
    next_block = 0
    for seq_id, length in enumerate(lengths):
        plan.new_sequences.append(NewSequence(seq_id, SamplingParams(), num_prompt_tokens=length))
        plan.seq_ids.append(seq_id)
        plan.start_positions.append(0)
        plan.sample.append(True)
        plan.token_ids.extend([1] * length)
        plan.token_offsets.append(len(plan.token_ids))
        num_blocks = -(-length // block_size)
        plan.block_ids.extend(range(next_block, next_block + num_blocks))
        plan.block_offsets.append(len(plan.block_ids))
        next_block += num_blocks
    plan.forget_seq_ids = list(range(len(lengths)))
    return plan


def warm_up(engine, max_num_seqs: int) -> int:
    """Run the warm-up steps on `engine` (CUDA, triton backend; else nothing); returns how
    many ran. Logs them, their time and the Triton variants compiled."""
    if engine.device.type != "cuda" or engine.attention_backend.name != "triton":
        return 0
    import torch

    from pagoda.gpu_worker.attention.triton_paged import split_kv_segments

    num_kv_heads = engine.pool.geometry.num_kv_heads
    device = engine.device

    def segments_for(num_seqs: int) -> int:
        return split_kv_segments(num_seqs, num_kv_heads, 1, device)

    started_s = time.monotonic()
    variants_before = compiled_variants()
    plans = warm_up_plans(
        decode_batch_sizes(segments_for, max_num_seqs),
        min(PREFILL_CHUNK_TOKENS, engine.facts.max_context_tokens),
        engine.block_size,
        engine.facts.num_kv_blocks,
    )
    for plan in plans:
        result = engine.step(plan)
        if result.step_error:
            raise RuntimeError(f"a warm-up step failed: {result.step_error}")
    torch.cuda.synchronize(device)  # once, at load
    variants_after = compiled_variants()
    compiled = (
        "an unknown number of"
        if variants_before is None or variants_after is None
        else str(variants_after - variants_before)
    )
    log.info(
        "warm-up: %d steps compiled %s Triton variants in %.1f s (%s in all)",
        len(plans),
        compiled,
        time.monotonic() - started_s,
        "?" if variants_after is None else variants_after,
    )
    return len(plans)


def compiled_variants() -> int | None:
    """Compiled variants of the worker's Triton kernels so far, or None where this Triton
    does not say (its JIT cache layout is private and changes between versions)."""
    from pagoda.gpu_worker import fused_ops
    from pagoda.gpu_worker.attention import triton_paged

    kernels = [
        triton_paged._write_kv_kernel,
        triton_paged._paged_attention_kernel,
        triton_paged._reduce_segments_kernel,
        fused_ops._rms_norm_kernel,
        fused_ops._silu_and_mul_kernel,
        fused_ops._rotary_kernel,
    ]
    total = 0
    for kernel in kernels:
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            return None
        for entry in caches.values():
            cache = entry[0] if isinstance(entry, tuple) else None
            if not isinstance(cache, dict):
                return None
            total += len(cache)
    return total
