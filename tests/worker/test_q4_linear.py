"""Q4Linear, the default model's int8 path: Linear weights held as their exact Q4_1 groups
(the GGUF's 4-bit levels), on Pagoda's AVX2 kernel (float32 activations, gpu_worker/
cpu_kernels.py) or, where it cannot run, on PyTorch's CPU int4 GEMM (bfloat16 activations).
Every test runs on both paths."""

from __future__ import annotations

import copy

import pytest
import torch

from pagoda.gpu_worker import cpu_kernels
from pagoda.gpu_worker.numerics import describe_numerics
from pagoda.gpu_worker.quantization import (
    Int8Linear,
    Q4Linear,
    RescoredHead,
    count_q4_linear,
    q4_1_blocks,
    quantize_int8,
    round_to_q4_1,
)


@pytest.fixture(params=["kernel", "int4pack"])
def q4_path(request, monkeypatch) -> str:
    """Which path Q4Linear layers built in the test take: Pagoda's kernel, or PyTorch's
    int4 GEMM as on a CPU without AVX2 or a C compiler."""
    if request.param == "kernel":
        if cpu_kernels.load() is None:
            pytest.skip("Pagoda's Q4_1 kernel cannot be built or run here")
    else:
        monkeypatch.setattr(cpu_kernels, "load", lambda cache_dir=None: None)
    return request.param


def q4_1_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return round_to_q4_1(torch.randn(out_features, in_features, generator=generator) * 0.05)


def test_q4_1_blocks_hold_a_q4_1_weight_exactly_and_refuse_others():
    weight = q4_1_weight(96, 128)
    blocks = q4_1_blocks(weight)
    assert blocks is not None
    assert blocks.levels.min() >= 0 and blocks.levels.max() <= 15
    rebuilt = blocks.levels.view(96, 4, 32) * blocks.scales.unsqueeze(-1)
    assert torch.equal((rebuilt + blocks.minimums.unsqueeze(-1)).view(96, 128), weight)
    # A float weight is not rounded to 4 bits behind the user's back.
    assert q4_1_blocks(torch.randn(96, 128)) is None
    assert q4_1_blocks(q4_1_weight(96, 128)[:, :100]) is None  # not whole groups


def test_q4_linear_computes_the_float_product(q4_path):
    weight, bias = q4_1_weight(192, 256), torch.randn(192)
    layer = Q4Linear(q4_1_blocks(weight), bias)
    x = torch.randn(2, 5, 256)
    exact = x.double() @ weight.double().t() + bias.double()
    got = layer(x)
    assert got.shape == exact.shape and got.dtype == torch.float32
    # The kernel: float32 throughout, only the order of the sum differs. int4pack:
    # bfloat16 inputs and outputs, about 3 significant digits.
    tolerance = 1e-5 if q4_path == "kernel" else 0.02
    assert (got.double() - exact).abs().max() <= tolerance * exact.abs().max()


@pytest.mark.parametrize("out_features", [8, 40, 96])
def test_the_kernel_rebuilds_each_weight_exactly_as_the_float_model_holds_it(q4_path, out_features):
    if q4_path != "kernel":
        pytest.skip("int4pack rounds the scale and offset to bfloat16")
    weight = q4_1_weight(out_features, 64)
    # Row i of the identity picks input i: each output is then fma(1, w, 0) + 0 = w.
    for rows in (1, 2, 3, 64):  # both of the kernel's loops (few rows, strips)
        eye = torch.eye(64)[:rows]
        got = Q4Linear(q4_1_blocks(weight), None)(eye)
        assert torch.equal(got, weight.t()[:rows]), rows


@pytest.mark.parametrize("in_features", [256, 1536])
def test_q4_linear_rows_do_not_depend_on_their_batch_mates(q4_path, in_features):
    generator = torch.Generator().manual_seed(1)
    layer = Q4Linear(q4_1_blocks(q4_1_weight(64, in_features)), None)
    row = torch.randn(1, in_features, generator=generator)
    alone = layer(row)
    for num_mates in (1, 2, 3, 4, 7, 12, 31, 64, 129, 600):
        mates = torch.randn(num_mates, in_features, generator=generator)
        for position in (0, num_mates // 2, num_mates):
            batch = torch.cat([mates[:position], row, mates[position:]])
            assert torch.equal(layer(batch)[position], alone[0]), (num_mates, position)


def test_the_kernels_rows_do_not_depend_on_the_number_of_threads(q4_path):
    out_features = 72 if q4_path == "kernel" else 64  # the kernel: an odd number of tiles
    layer = Q4Linear(q4_1_blocks(q4_1_weight(out_features, 96)), torch.randn(out_features))
    x = torch.randn(37, 96)
    threads = torch.get_num_threads()
    try:
        results = []
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            results.append(layer(x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(result, results[0]) for result in results)


def test_int8_runs_q4_1_decoder_layers_as_q4_and_the_rest_as_before(q4_path, llama_models):
    model = copy.deepcopy(llama_models.reference)
    head = model.get_output_embeddings()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                module.weight.copy_(round_to_q4_1(module.weight))
    float_logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    quantize_int8(model)
    assert count_q4_linear(model) == 7 * model.config.num_hidden_layers
    assert not any(isinstance(m, Int8Linear) for m in model.model.layers.modules())
    assert isinstance(model.get_output_embeddings(), RescoredHead)
    from pagoda.gpu_worker.quantization import FusedQ4Linear

    calls = []
    for module in model.modules():
        if isinstance(module, FusedQ4Linear):
            module.layer.register_forward_hook(lambda *_: calls.append(1))
    logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert torch.equal(logits.argmax(-1), float_logits.argmax(-1))
    # q/k/v and gate/up: one kernel call per group and layer.
    assert len(calls) == 2 * model.config.num_hidden_layers
    numerics = describe_numerics(model, "int8")
    assert "q_proj" in numerics and "as Q4_1" in numerics
    if q4_path == "kernel":
        assert "exact weights, float32 activations, float32 sums in input order" in numerics
    else:
        assert "scale and offset in bfloat16, bfloat16 activations" in numerics
    assert "q_proj/k_proj/v_proj and gate_proj/up_proj in one call each" in numerics
    first = "int8"
    if q4_path == "kernel":
        first = (
            "int8 weights x int8 activations, int32 sums (Pagoda's VNNI kernel)"
            if model.get_output_embeddings().int8.integer
            else "int8 weights x float32 activations (Pagoda's kernel)"
        )
    assert f"head: {first} logits, each row's top 32 recomputed in float32" in numerics


def test_int8_keeps_per_token_int8_for_weights_that_are_not_q4_1(llama_models):
    model = quantize_int8(copy.deepcopy(llama_models.reference))
    assert count_q4_linear(model) == 0
    numerics = describe_numerics(model, "int8")
    assert "per-token symmetric int8 (absmax / 127)" in numerics and "Q4_1" not in numerics


def test_fused_siblings_give_the_bits_of_separate_layers_and_never_a_stale_result(q4_path):
    from pagoda.gpu_worker.quantization import FusedQ4Linear, Q4Slice

    weights = [q4_1_weight(n, 128, seed) for seed, n in enumerate((64, 32, 32))]
    biases = [torch.randn(64), None, torch.randn(32)]
    separate = [Q4Linear(q4_1_blocks(w), b) for w, b in zip(weights, biases, strict=True)]
    fused = FusedQ4Linear([q4_1_blocks(w) for w in weights], biases)
    q, k, v = (
        Q4Slice(fused, 0, 64, True, 2),
        Q4Slice(fused, 64, 96, False, 0),
        Q4Slice(fused, 96, 128, False, 0),
    )
    x, y = torch.randn(3, 128), torch.randn(3, 128)
    for first, second in ((x, x), (x, y)):
        assert torch.equal(q(first), separate[0](first))
        assert torch.equal(k(second), separate[1](second))  # another input: computed afresh
        assert torch.equal(v(second), separate[2](second))
    assert torch.equal(v(x), separate[2](x))  # called alone, out of order


def test_a_layer_the_int4_gemm_cannot_hold_is_not_made_q4_without_the_kernel(q4_path):
    from pagoda.gpu_worker.quantization import q4_linear_takes

    assert q4_linear_takes(32) and q4_linear_takes(48)
    # The kernel takes tiles of 8 outputs; PyTorch's int4 GEMM refuses 24 or 40.
    assert q4_linear_takes(24) == (q4_path == "kernel")
    assert q4_linear_takes(40) == (q4_path == "kernel")
