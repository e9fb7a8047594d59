"""Building and loading Pagoda's CPU kernels (gpu_worker/cpu_kernels.py): once per source
into their cache folder, and a clear fallback where they cannot be built. Their arithmetic
is tested through their callers: Q4Linear (test_q4_linear.py) and the `cpu` attention
backend (test_attention_backends.py, test_batch_invariance.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from pagoda.gpu_worker import cpu_kernels


@pytest.fixture
def kernels_here():
    if cpu_kernels.load() is None:
        pytest.skip("Pagoda's CPU kernels cannot be built or run here")


def test_the_kernels_are_built_once_per_source_into_their_cache(kernels_here, tmp_path):
    first = cpu_kernels._build(tmp_path)
    built = first.stat().st_mtime_ns
    assert cpu_kernels._build(tmp_path) == first
    assert first.stat().st_mtime_ns == built  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial file left


def test_a_source_that_does_not_compile_leaves_pytorchs_ops(
    kernels_here, tmp_path, monkeypatch, caplog
):
    broken = tmp_path / "broken.c"
    broken.write_text("int q4_1_gemm(void) { return }\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (broken,))
    with caplog.at_level(logging.WARNING, logger="pagoda.cpu_kernels"):
        assert cpu_kernels.load(tmp_path / "cache") is None
    assert "CPU kernels are unavailable" in caplog.text and "failed" in caplog.text
    assert not any((tmp_path / "cache").iterdir())  # the partial library is removed


def test_pack_refuses_a_weight_that_is_not_whole_tiles():
    levels = torch.zeros(12, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="not whole tiles"):
        cpu_kernels.pack_q4_1(levels, torch.ones(12, 2), torch.zeros(12, 2))


def test_pack_keeps_the_top_level_of_the_last_output_of_a_tile():
    levels = torch.full((8, 32), 15, dtype=torch.int32)  # every bit of each word set
    packed = cpu_kernels.pack_q4_1(levels, torch.ones(8, 1), torch.zeros(8, 1))
    assert packed.levels.dtype == torch.int32
    assert torch.equal(packed.levels, torch.full((1, 32), -1, dtype=torch.int32))


def test_an_empty_call_gives_an_empty_output(kernels_here):
    levels = torch.randint(0, 16, (16, 64), dtype=torch.int32)
    packed = cpu_kernels.pack_q4_1(levels, torch.ones(16, 2), torch.zeros(16, 2))
    out = cpu_kernels.load().q4_1_matmul(torch.zeros(0, 64), packed)
    assert out.shape == (0, 16)
