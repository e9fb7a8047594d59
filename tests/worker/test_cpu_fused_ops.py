"""The CPU kernels' dense ops (gpu_worker/kernels/elementwise.c, patched in by
fused_model.py under `int8` on the CPU) against the torch expressions they replace, their
batch invariance, and a tiny Llama and Qwen3 patched with them against the same models
unpatched.

Tolerances: RoPE and the residual sum round exactly where HF rounds (bit-equal); the
norm's mean of squares is summed in another order and SiLU's exp is another
implementation, so those are within float32's 1e-6 relative.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pagoda.gpu_worker import cpu_kernels
from pagoda.gpu_worker.fused_model import cpu_fusable, fuse_model, rotary_cos_sin
from tests.worker.fused_models import tiny_model

CLOSE = {"rtol": 1e-6, "atol": 1e-6}


@pytest.fixture(scope="module")
def kernels():
    loaded = cpu_kernels.load()
    if loaded is None:
        pytest.skip("Pagoda's CPU kernels cannot be built or run here")
    return loaded


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm forward in float32."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb on one tensor: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def with_threads(count: int, function):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return function()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_is_hf_rms_norm(kernels, rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 576, generator=generator) * 3
    residual = torch.randn(1, rows, 576, generator=generator)
    weight = torch.randn(576, generator=generator)
    torch.testing.assert_close(
        kernels.rms_norm(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5), **CLOSE
    )
    normed, summed = kernels.rms_norm(x, weight, 1e-5, residual=residual)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, hf_rms_norm(x + residual, weight, 1e-5), **CLOSE)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_silu_and_mul_is_silu_times_up(kernels, rows):
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4
    gate_up[0, :4] = torch.tensor([-100.0, -30.0, 30.0, 0.0])  # the exp's far ends
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), expected, **CLOSE)


def test_rotary_is_hf_rotary_bit_for_bit(kernels):
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=576, num_attention_heads=9, max_position_embeddings=4096
    )
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 2, 63, 900, 4095]])
    cos, sin = rotary(torch.zeros(1), positions)  # [1, T, 64]
    table = rotary_cos_sin(rotary.inv_freq, 4096, float(rotary.attention_scaling))
    generator = torch.Generator().manual_seed(0)
    # query and key as the fused projection leaves them: column slices of one output
    joined = torch.randn(6, 9 * 64 + 3 * 64 + 3 * 64, generator=generator)
    query = joined[:, : 9 * 64].view(6, 9, 64)
    key = joined[:, 9 * 64 : 12 * 64].view(6, 3, 64)
    expected_query = hf_rotary(query, cos[0, :, None], sin[0, :, None])
    expected_key = hf_rotary(key, cos[0, :, None], sin[0, :, None])
    values = joined[:, 12 * 64 :].clone()
    kernels.rotary_in_place(query, key, positions[0], table)
    assert torch.equal(query, expected_query)
    assert torch.equal(key, expected_key)
    assert torch.equal(joined[:, 12 * 64 :], values)  # the value columns are left alone


def test_a_rows_bits_do_not_depend_on_its_batch_or_the_threads(kernels):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(70, 576, generator=generator)
    residual = torch.randn(70, 576, generator=generator)
    weight = torch.randn(576, generator=generator)
    gate_up = torch.randn(70, 3072, generator=generator)

    def norm(rows: slice):
        return kernels.rms_norm(x[rows], weight, 1e-5, residual=residual[rows])

    normed, summed = with_threads(2, lambda: norm(slice(None)))
    silu = with_threads(2, lambda: kernels.silu_and_mul(gate_up))
    for row in (0, 41, 69):
        one = slice(row, row + 1)
        alone_normed, alone_summed = with_threads(1, lambda one=one: norm(one))
        assert torch.equal(alone_normed[0], normed[row])
        assert torch.equal(alone_summed[0], summed[row])
        assert torch.equal(kernels.silu_and_mul(gate_up[one])[0], silu[row])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_model_patched_with_the_cpu_ops_computes_the_same_logits(kernels, family):
    model = tiny_model(family)
    assert cpu_fusable(model)
    fused = copy.deepcopy(model)
    counts = fuse_model(fused, num_positions=256, ops=kernels)
    assert (counts.layers, counts.mlps, counts.attentions) == (2, 2, 2)
    input_ids = torch.randint(3, 512, (1, 41), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(41)[None, :] + 100  # a chunk after 100 cached tokens
    with torch.inference_mode():
        expected = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
        got = fused(input_ids=input_ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_widths_the_kernels_cannot_take_are_left_to_pytorch():
    model = tiny_model("llama")
    assert cpu_fusable(model)
    model.config.intermediate_size = 100  # not whole vectors of 8
    assert not cpu_fusable(model)
    assert not cpu_fusable(tiny_model("llama").to(torch.bfloat16))
