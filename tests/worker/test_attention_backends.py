"""Which attention backend `create_backend` gives for a device and a KV block size."""

from __future__ import annotations

import pytest

from pagoda.gpu_worker.attention import (
    BackendUnavailableError,
    create_backend,
    triton_block_size_problem,
)


@pytest.mark.parametrize("block_size", [1, 8, 16, 24, 48, 128, 256, 1024])
def test_triton_takes_every_block_size_the_worker_allows(block_size):
    # Its key tile is independent of the block size (tests/worker/test_triton_attention.py).
    assert triton_block_size_problem(block_size) is None


def test_the_cpu_gets_pagodas_kernel_or_the_reference_backend(monkeypatch):
    from pagoda.gpu_worker import cpu_kernels

    expected = "reference" if cpu_kernels.load() is None else "cpu"
    assert create_backend("auto", "cpu", 16).name == expected
    # Where the kernels cannot be built, auto falls back; an explicit cpu says so at the call.
    monkeypatch.setattr(cpu_kernels, "load", lambda cache_dir=None: None)
    assert create_backend("auto", "cpu", 16).name == "reference"
    with pytest.raises(BackendUnavailableError, match="only on CUDA"):
        create_backend("triton", "cpu", 16)
    with pytest.raises(BackendUnavailableError, match="only on the CPU"):
        create_backend("cpu", "cuda", 16)
