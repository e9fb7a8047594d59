"""Which attention backend `create_backend` gives for a device and a KV block size."""

from __future__ import annotations

import pytest
from pagoda.gpu_worker.attention import (
    BackendUnavailableError,
    create_backend,
    triton_block_size_problem,
)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_triton_takes_power_of_two_blocks_of_16_or_more(block_size):
    assert triton_block_size_problem(block_size) is None


@pytest.mark.parametrize("block_size", [1, 8, 24, 48])
def test_auto_falls_back_to_the_reference_where_triton_cannot_tile_the_blocks(block_size):
    assert "power-of-two block size of 16 or more" in triton_block_size_problem(block_size)
    assert create_backend("auto", "cuda", block_size).name == "reference"
    with pytest.raises(BackendUnavailableError, match=f"not {block_size}"):
        create_backend("triton", "cuda", block_size)


def test_the_cpu_gets_the_reference_backend():
    assert create_backend("auto", "cpu", 16).name == "reference"
    with pytest.raises(BackendUnavailableError, match="only on CUDA"):
        create_backend("triton", "cpu", 16)
