"""Sizing the KV pool on CUDA from a profiling forward, before the pool exists.

The pool gets what the device can spare at the worst step: `utilization` of the total
memory, less what is in use at the peak of the largest step the scheduler may send
(weights, that step's activations and sampler temporaries, the CUDA context and other
processes). A pool sized from the memory free after loading the weights alone leaves
the activations of a long prefill to whatever remains, and runs out of memory there.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

from pagoda.common.step import NewSequence, SamplingParams, StepPlan

log = logging.getLogger("pagoda.worker.kv_sizing")

PROFILE_MAX_SEQS = 256  # sequences the profiling step splits its tokens over (logits rows)
# The profiling rows sample with top-p: the sampler's costliest path (a full sort).
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, seed=1)


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    total_bytes: int  # the device's memory
    in_use_bytes: int  # used on the device after the profile, by anyone (mem_get_info)
    reserved_bytes: int  # held by this process's torch allocator after the profile
    peak_allocated_bytes: int  # torch's peak during the profile
    probe_pool_bytes: int  # the profiling pool's share of that peak (freed before sizing)


def kv_budget_bytes(profile: MemoryProfile, utilization: float) -> int:
    """Bytes the KV pool may take: utilization x total, less the peak in use without the
    probe pool. Memory outside torch's allocator (CUDA context, cuBLAS workspaces, other
    processes) is what the device has in use beyond this process's reservation."""
    outside_torch = max(0, profile.in_use_bytes - profile.reserved_bytes)
    peak_without_pool = profile.peak_allocated_bytes - profile.probe_pool_bytes
    return int(profile.total_bytes * utilization - outside_torch - peak_without_pool)


def profile_plan(num_tokens: int, max_context_tokens: int, block_size: int) -> StepPlan:
    """One step of `num_tokens` fed tokens from position 0 on blocks 0, 1, 2, ...: one long
    sequence (half the tokens, at most max_context_tokens: attention's largest temporaries)
    and the rest over up to PROFILE_MAX_SEQS - 1 more sampling sequences (the most logits)."""
    lengths = [min(max(1, num_tokens // 2), max_context_tokens)]
    rest = num_tokens - lengths[0]
    if rest:
        num_short = max(min(PROFILE_MAX_SEQS - 1, rest), -(-rest // max_context_tokens))
        lengths += [rest // num_short + (i < rest % num_short) for i in range(num_short)]
    plan = StepPlan(step_id=0, token_offsets=[0], block_offsets=[0])
    next_block = 0
    num_seqs = len(lengths)
    for seq_id, length in enumerate(lengths):
        plan.new_sequences.append(NewSequence(seq_id, PROFILE_SAMPLING, num_prompt_tokens=length))
        plan.seq_ids.append(seq_id)
        plan.start_positions.append(0)
        plan.sample.append(True)
        plan.token_ids.extend([seq_id % 100 + 1] * length)  # any ids inside the vocabulary
        plan.token_offsets.append(len(plan.token_ids))
        num_blocks = -(-length // block_size)
        plan.block_ids.extend(range(next_block, next_block + num_blocks))
        plan.block_offsets.append(len(plan.block_ids))
        next_block += num_blocks
    plan.forget_seq_ids = list(range(num_seqs))
    return plan


def profile_num_blocks(plan: StepPlan) -> int:
    return len(plan.block_ids)


def measure_memory(make_engine, plan: StepPlan, device) -> MemoryProfile:
    """Run the profiling `plan` on an engine from `make_engine(num_kv_blocks)` (a probe pool
    just large enough), then free it; CUDA only."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    engine = make_engine(profile_num_blocks(plan))
    result = engine.step(plan)
    torch.cuda.synchronize(device)
    if result.step_error:
        raise RuntimeError(f"the KV-sizing profiling step failed: {result.step_error}")
    probe_pool_bytes = engine.pool.num_bytes
    peak_allocated_bytes = torch.cuda.max_memory_allocated(device)
    del engine, result
    gc.collect()
    torch.cuda.empty_cache()
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    return MemoryProfile(
        total_bytes=total_bytes,
        in_use_bytes=total_bytes - free_bytes,
        reserved_bytes=torch.cuda.memory_reserved(device),
        peak_allocated_bytes=peak_allocated_bytes,
        probe_pool_bytes=probe_pool_bytes,
    )
