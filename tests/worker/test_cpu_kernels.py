"""Building and loading Pagoda's CPU kernels (gpu_worker/cpu_kernels.py): once per source
into their cache folder, and a clear fallback where they cannot be built. Their arithmetic
is tested through their callers: Q4Linear (test_q4_linear.py) and the `cpu` attention
backend (test_attention_backends.py, test_batch_invariance.py); the selections over logits
(select.c) here, against torch's."""

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


def test_pack_refuses_scales_that_are_not_float16_values():
    """Q4_1's d and m are float16 (q4_1_blocks finds them so); the kernel reads them so."""
    levels = torch.zeros(8, 32, dtype=torch.int32)
    with pytest.raises(ValueError, match="float16 values"):
        cpu_kernels.pack_q4_1(levels, torch.full((8, 1), 0.1), torch.zeros(8, 1))


def test_pack_keeps_the_top_level_of_the_last_output_of_a_tile():
    levels = torch.full((8, 32), 15, dtype=torch.int32)  # every bit of each word set
    packed = cpu_kernels.pack_q4_1(levels, torch.ones(8, 1), torch.zeros(8, 1))
    assert packed.levels.dtype == torch.int32
    # One tile, paired with a tile of zeros: [tile pairs, inputs, 2].
    assert torch.equal(packed.levels[..., 0], torch.full((1, 32), -1, dtype=torch.int32))
    assert torch.equal(packed.levels[..., 1], torch.zeros(1, 32, dtype=torch.int32))


def test_an_empty_call_gives_an_empty_output(kernels_here):
    levels = torch.randint(0, 16, (16, 64), dtype=torch.int32)
    packed = cpu_kernels.pack_q4_1(levels, torch.ones(16, 2), torch.zeros(16, 2))
    out = cpu_kernels.load().q4_1_matmul(torch.zeros(0, 64), packed)
    assert out.shape == (0, 16)


def test_int8_rows_rebuild_each_weight_as_its_level_times_its_rows_scale(kernels_here):
    weight = torch.randn(40, 64) * 0.05
    packed = cpu_kernels.pack_int8(weight)
    levels = (weight / packed.scales[:, None]).round().clamp(-127, 127)
    assert (levels * packed.scales[:, None] - weight).abs().max() <= packed.scales.max() / 2
    kernels = cpu_kernels.load()
    for rows in (1, 3, 4, 64):  # both loops: few rows, strips
        got = kernels.int8_matmul(torch.eye(64)[:rows], packed)
        assert torch.equal(got, (levels * packed.scales[:, None]).t()[:rows]), rows


@pytest.mark.parametrize("out_features", [88, 128])  # gemm.c's; int8_dot.c's where it runs
def test_int8_rows_do_not_depend_on_their_batch_mates_or_threads(kernels_here, out_features):
    from pagoda.gpu_worker.quantization import Int8RowsLinear

    generator = torch.Generator().manual_seed(2)
    layer = Int8RowsLinear(
        torch.randn(out_features, 96, generator=generator),
        torch.randn(out_features),
        cpu_kernels.load(),
    )
    row = torch.randn(1, 96, generator=generator)
    alone = layer(row)
    threads = torch.get_num_threads()
    try:
        for num_threads, num_mates in ((1, 1), (2, 5), (3, 40), (2, 129)):
            torch.set_num_threads(num_threads)
            mates = torch.randn(num_mates, 96, generator=generator)
            at = min(2, num_mates)
            batch = torch.cat([mates[:at], row, mates[at:]])
            assert torch.equal(layer(batch)[at], alone[0]), (num_threads, num_mates)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def int8_dot_here(kernels_here):
    if not cpu_kernels.load().int8_dot:
        pytest.skip("this CPU has no AVX-512 VNNI: int8_dot.c does not run")


def int8_dot_reference(x, weight, bias=None):
    """int8_dot.c's arithmetic in torch: x rounded per row at max |x| / 127, exact integer
    sums (int64 here), then float32 (* step) (* scale) (+ bias), each rounding once."""
    levels, scales = cpu_kernels._int8_rows(weight)
    steps = x.abs().amax(dim=1, keepdim=True) / 127
    rounded = torch.where(steps > 0, x / steps, 0).round().long()
    out = (rounded @ levels.long().t()).float() * steps * scales
    return out if bias is None else out + bias


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 131])  # whole and ragged blocks of 6
@pytest.mark.parametrize("shape", [(64, 8), (128, 96), (192, 576)])
def test_int8_dot_is_its_integer_arithmetic_bit_for_bit(int8_dot_here, rows, shape):
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(shape, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator) * 3
    x[0, 1] = 40.0  # an outlier sets the row's step
    if rows > 2:
        x[2] = 0.0  # a zero row stays zero
    kernels = cpu_kernels.load()
    packed = cpu_kernels.pack_int8_dot(weight)
    assert torch.equal(kernels.int8_dot_matmul(x, packed), int8_dot_reference(x, weight))
    got = kernels.int8_dot_matmul(x, packed, bias)
    assert torch.equal(got, int8_dot_reference(x, weight, bias))
    torch.testing.assert_close(got, x @ weight.t() + bias, rtol=0.02, atol=0.05 * in_features**0.5)


def test_pack_int8_dot_rounds_as_pack_int8_and_refuses_ragged_tiles():
    weight = torch.randn(64, 32)
    dot, rows = cpu_kernels.pack_int8_dot(weight), cpu_kernels.pack_int8(weight)
    assert torch.equal(dot.scales, rows.scales)
    assert torch.equal(
        dot.levels.transpose(1, 2).reshape(64, 32), rows.levels.transpose(1, 2).reshape(64, 32)
    )
    assert torch.equal(dot.offsets, 128 * rows.levels.int().sum(dim=(1,)).flatten())
    with pytest.raises(ValueError, match="not whole tiles"):
        cpu_kernels.pack_int8_dot(torch.randn(56, 32))


# few rows (1-3, then passes of up to four on AVX-512), then strips
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 11, 12, 27, 64, 130])
# ragged eights, twelves (one or two rows) and fours
@pytest.mark.parametrize("out_features", [32, 56, 72, 88, 96, 128, 200])
def test_the_avx512_loops_give_the_avx2_loops_bits(kernels_here, rows, out_features):
    """Each lane of a 512-bit register computes its output's one chain of FMAs, as an AVX2
    lane does: the same bits, Q4_1 with a bias and int8, ragged row blocks and tiles."""
    kernels = cpu_kernels.load()
    if not kernels.avx512():
        pytest.skip("this CPU has no AVX-512: only the AVX2 loops run")
    generator = torch.Generator().manual_seed(rows + out_features)
    levels = torch.randint(0, 16, (out_features, 96), dtype=torch.int32, generator=generator)
    scales = (torch.rand(out_features, 3, generator=generator) / 8).half().float()
    packed = cpu_kernels.pack_q4_1(levels, scales, -8 * scales)
    packed_int8 = cpu_kernels.pack_int8(torch.randn(out_features, 96, generator=generator))
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, 96, generator=generator)
    wide = kernels.q4_1_matmul(x, packed, bias), kernels.int8_matmul(x, packed_int8)
    try:
        assert not kernels.avx512(False)
        narrow = kernels.q4_1_matmul(x, packed, bias), kernels.int8_matmul(x, packed_int8)
    finally:
        assert kernels.avx512(True)
    assert torch.equal(wide[0], narrow[0]) and torch.equal(wide[1], narrow[1])
    expected = (
        x @ (levels * scales.repeat_interleave(32, 1) - 8 * scales.repeat_interleave(32, 1)).t()
    )
    torch.testing.assert_close(wide[0], expected + bias, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cols", [1, 7, 8, 13, 64, 49152])
def test_argmax_rows_is_torchs_argmax(kernels_here, cols):
    """The first largest of each row, as torch.argmax: ties, a row of -inf (a masked row),
    NaNs (torch takes the first NaN), widths below and off whole vectors."""
    generator = torch.Generator().manual_seed(cols)
    x = torch.randn(9, cols, generator=generator)
    x[1] = 0.0  # all tied
    x[2] = -float("inf")
    x[3, cols // 2 :] = x[3].max() + 1  # the largest repeated to the end
    x[4, cols - 1] = float("nan")
    x[5, cols // 3] = float("nan")
    x[5, cols - 1] = float("nan")
    x[6, 0] = float("inf")
    got = cpu_kernels.load().argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))


@pytest.mark.parametrize(("cols", "k"), [(49152, 32), (40, 32), (33, 33), (100, 1), (9, 4)])
def test_top_k_rows_keeps_the_k_largest_ties_to_the_lower_index(kernels_here, cols, k):
    kernels = cpu_kernels.load()
    generator = torch.Generator().manual_seed(cols + k)
    x = torch.randn(6, cols, generator=generator)
    got = kernels.top_k_rows(x, k).sort(dim=-1).values
    assert torch.equal(got, x.topk(k, dim=-1).indices.sort(dim=-1).values)
    tied = torch.zeros(2, cols)
    tied[1, cols - 1] = 1.0  # one larger at the end, the rest tied
    expected = torch.stack([torch.arange(k), torch.tensor([*range(k - 1), cols - 1])])
    assert torch.equal(kernels.top_k_rows(tied, k).sort(dim=-1).values, expected)
    for row in (0, 5):  # a row's answer is its own
        alone = kernels.top_k_rows(x[row : row + 1].clone(), k)
        assert torch.equal(alone[0], kernels.top_k_rows(x, k)[row])
    with pytest.raises(ValueError, match="of"):
        kernels.top_k_rows(x, cols + 1)
