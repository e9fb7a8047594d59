"""Sizing the KV pool after a profiling step (issue 16 item 1): the arithmetic, the
profiling plan, and that plan running through a real engine (CPU here; the memory
measurement itself needs CUDA)."""

from __future__ import annotations

from itertools import pairwise

import pytest

from pagoda.gpu_worker.kv_sizing import (
    PROFILE_MAX_SEQS,
    MemoryProfile,
    kv_budget_bytes,
    profile_num_blocks,
    profile_plan,
)
from pagoda.gpu_worker.model_loader import auto_dtype_name

GIB = 1 << 30


def test_budget_is_utilization_less_the_peak_without_the_probe_pool():
    profile = MemoryProfile(
        total_bytes=80 * GIB,
        in_use_bytes=10 * GIB,  # 7 GiB reserved by torch + 3 GiB context and others
        reserved_bytes=7 * GIB,
        peak_allocated_bytes=6 * GIB,  # weights + activations + a 1 GiB probe pool
        probe_pool_bytes=1 * GIB,
    )
    # 0.9 * 80 = 72; less 3 outside torch, less 5 of weights and activations.
    assert kv_budget_bytes(profile, 0.9) == 64 * GIB


def test_budget_goes_negative_when_the_step_does_not_fit():
    profile = MemoryProfile(
        total_bytes=8 * GIB,
        in_use_bytes=2 * GIB,
        reserved_bytes=2 * GIB,
        peak_allocated_bytes=9 * GIB,
        probe_pool_bytes=0,
    )
    assert kv_budget_bytes(profile, 0.9) < 0  # num_blocks_for_budget then refuses to start


@pytest.mark.parametrize(
    ("num_tokens", "max_context"), [(1, 2048), (7, 2048), (2048, 2048), (8192, 1024), (300, 64)]
)
def test_profile_plan_feeds_exactly_the_tokens_within_the_context(num_tokens, max_context):
    block_size = 16
    plan = profile_plan(num_tokens, max_context, block_size)
    lengths = [b - a for a, b in pairwise(plan.token_offsets)]
    assert sum(lengths) == len(plan.token_ids) == num_tokens
    assert all(1 <= n <= max_context for n in lengths)
    assert len(lengths) <= max(PROFILE_MAX_SEQS, -(-num_tokens // max_context) + 1)
    assert lengths[0] == max(lengths)  # the long sequence (attention's biggest temporaries)
    blocks = [b - a for a, b in pairwise(plan.block_offsets)]
    assert blocks == [-(-n // block_size) for n in lengths]
    assert sorted(plan.block_ids) == list(range(profile_num_blocks(plan)))  # no block shared
    assert plan.forget_seq_ids == plan.seq_ids == [new.seq_id for new in plan.new_sequences]


def test_the_profile_plan_runs_on_an_engine_and_leaves_nothing(llama_models):
    plan = profile_plan(300, 64, 4)
    engine = llama_models.engine(num_kv_blocks=profile_num_blocks(plan), block_size=4)
    result = engine.step(plan)
    assert not result.step_error and not result.errors
    assert len(result.token_ids) == len(plan.seq_ids)
    assert len(engine.table) == 0


@pytest.mark.parametrize(
    ("device", "bf16", "expected"),
    [
        ("cpu", False, "float32"),
        ("cpu", True, "float32"),
        ("cuda", True, "bfloat16"),
        ("cuda:1", True, "bfloat16"),
        ("cuda", False, "float16"),  # pre-Ampere: no native bfloat16
    ],
)
def test_auto_dtype_needs_bfloat16_support(device, bf16, expected):
    assert auto_dtype_name(device, bf16_supported=bf16) == expected


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
def test_an_engine_on_cuda_turns_cudnn_attention_off(llama_models):
    import copy

    import torch

    from pagoda.gpu_worker.paged_engine import PagedEngine

    PagedEngine(copy.deepcopy(llama_models.reference).cuda(), model_id="t", num_kv_blocks=8)
    assert not torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
def test_measure_memory_on_cuda_sees_the_probe_pool(llama_models):
    import copy

    import torch

    from pagoda.gpu_worker.kv_sizing import measure_memory
    from pagoda.gpu_worker.paged_engine import PagedEngine

    model = copy.deepcopy(llama_models.reference).cuda()
    plan = profile_plan(256, 64, 16)
    profile = measure_memory(
        lambda n: PagedEngine(model, model_id="t", num_kv_blocks=n, block_size=16),
        plan,
        torch.device("cuda"),
    )
    assert profile.probe_pool_bytes > 0
    assert profile.peak_allocated_bytes > profile.probe_pool_bytes
    assert 0 < kv_budget_bytes(profile, 0.5) < profile.total_bytes
