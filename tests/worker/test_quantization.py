"""--quantization: int8 Linear layers that keep the paged attention and every architecture
working, the flag's resolution per device, and the hello that reports it."""

from __future__ import annotations

import copy
import random

import pytest

from tests.worker.conftest import TinyModels, random_prompts
from tests.worker.test_architectures import EXTRA, architecture_model
from tests.worker.toy_scheduler import ToyScheduler

NUM_BLOCKS = 256
BLOCK_SIZE = 4


def quantized_reference(model):
    """A quantized copy of `model` for generate(); the engine quantizes its own copy."""
    from pagoda.gpu_worker.quantization import quantize_int8

    return quantize_int8(copy.deepcopy(model))


def one_at_a_time(models: TinyModels, prompts: list[list[int]], num_new_tokens: int):
    """Greedy tokens of the int8 paged engine, one whole prompt per sequence and step."""
    scheduler = ToyScheduler(
        models.engine(num_kv_blocks=NUM_BLOCKS, quantization="int8"),
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
    )
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, prompt, admit_at_step=seq_id * (num_new_tokens + 1))
    return scheduler.run(num_new_tokens, max_steps=len(prompts) * (num_new_tokens + 2))


def assert_paged_int8_matches_generate(model, prompts, num_new_tokens: int = 8) -> None:
    from pagoda.gpu_worker.quantization import count_int8_linear

    models = TinyModels(None, model)
    reference = TinyModels(None, quantized_reference(model))
    assert count_int8_linear(reference.reference) > 0
    tokens = one_at_a_time(models, prompts, num_new_tokens)
    expected = {i: reference.greedy(p, num_new_tokens) for i, p in enumerate(prompts)}
    assert tokens == expected


def test_paged_int8_matches_the_quantized_model_generate(tiny_models):
    """llama, qwen2 (biases) and gpt2 (Conv1D, learned positions)."""
    assert_paged_int8_matches_generate(tiny_models.reference, random_prompts(3, seed=5))


@pytest.mark.parametrize("config_name", sorted(EXTRA))
def test_paged_int8_matches_generate_on_every_architecture(config_name):
    model = architecture_model(config_name)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 9, 20)]
    assert_paged_int8_matches_generate(model, prompts)


def test_int8_logits_are_finite_and_close_to_float(llama_models):
    import torch

    quantized = quantized_reference(llama_models.reference)
    input_ids = torch.tensor([random_prompts(1, seed=3, min_len=30, max_len=30)[0]])
    with torch.inference_mode():
        exact = llama_models.reference(input_ids=input_ids).logits[0]
        approx = quantized(input_ids=input_ids).logits[0]
    assert torch.isfinite(approx).all()
    assert not torch.equal(exact, approx)
    similarity = torch.nn.functional.cosine_similarity(exact, approx, dim=-1)
    # Random std-0.2 weights, smoothing alpha 0.3: measured 0.989.
    assert similarity.min() > 0.98, similarity.min()


def test_a_row_is_bit_exact_whatever_its_batch_mates_and_the_integer_sum_is_exact():
    """Each row has its own 8-bit grid (absmax / 127, -127..127) and the products are
    summed exactly in int32: a row with large activations beside it, or any number of
    rows, changes nothing; and the result is the integer product of the quantized row
    and weights, unclipped (no int16 saturation in the u8 x s8 kernel)."""
    import torch

    from pagoda.gpu_worker.quantization import Int8Linear

    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(256, 96)
    layer = Int8Linear(linear.weight, linear.bias)
    rows = torch.randn(40, 256, generator=generator)
    rows[3] *= 1000
    with torch.inference_mode():
        together = layer(rows)
        for num_rows in (1, 2, 3, 5, 17):
            assert torch.equal(layer(rows[:num_rows]), together[:num_rows]), num_rows
        assert torch.equal(layer(rows[7:8]), together[7:8])
        weight_scales = linear.weight.abs().amax(1) / 127
        weight_q = torch.round(linear.weight / weight_scales[:, None]).clamp(-127, 127)
        row_scales = rows.abs().amax(1, keepdim=True) / 127
        rows_q = torch.round(rows / row_scales).clamp(-127, 127)
        exact = (rows_q.double() @ weight_q.double().t()) * row_scales * weight_scales
        exact += linear.bias.double()
    # Equal but for float32 rounding (and a rare half-way rounding of a row element).
    assert torch.allclose(together.double(), exact, rtol=1e-4, atol=1e-3 * exact.abs().max())


def test_the_head_is_rescored_unless_asked_otherwise(llama_models):
    import torch

    from pagoda.gpu_worker.quantization import Int8Linear, RescoredHead, quantize_int8

    model = copy.deepcopy(llama_models.reference)
    float_weight = model.get_output_embeddings().weight
    head = quantize_int8(model).get_output_embeddings()
    assert isinstance(head, RescoredHead)
    # It rescores with the loaded weight (the embeddings', when tied), not a copy.
    assert head.weight.data_ptr() == float_weight.data_ptr()
    kept = quantize_int8(copy.deepcopy(llama_models.reference), head="float32")
    assert isinstance(kept.get_output_embeddings(), torch.nn.Linear)
    both = quantize_int8(copy.deepcopy(llama_models.reference), head="int8")
    assert isinstance(both.get_output_embeddings(), Int8Linear)
    with pytest.raises(ValueError, match="head must be one of"):
        quantize_int8(copy.deepcopy(llama_models.reference), head="fp8")


@pytest.mark.parametrize("first_pass", ["Int8Linear", "Int8RowsLinear"])
def test_the_rescored_head_decides_on_float_logits_where_int8_flips_near_ties(first_pass):
    """Rows 0 and 1 of the head differ by a hair, so their logits nearly tie: the int8
    head picks the wrong one for some inputs, the rescored head never does; its top
    logits are the float head's, the rest the int8 head's. The first pass is PyTorch's
    int8 GEMM or Pagoda's kernel (int8 rows of x and int32 sums where the CPU has VNNI)."""
    import torch

    from pagoda.gpu_worker import cpu_kernels
    from pagoda.gpu_worker.quantization import Int8Linear, Int8RowsLinear, RescoredHead

    kernels = cpu_kernels.load()
    if first_pass == "Int8RowsLinear" and kernels is None:
        pytest.skip("Pagoda's CPU kernels cannot be built or run here")

    generator = torch.Generator().manual_seed(0)
    vocab, width, num_rescored = 512, 64, 16
    weight = torch.randn(vocab, width, generator=generator)
    weight[1] = weight[0] + 1e-3 * torch.randn(width, generator=generator)
    weight[:2] *= 4  # the near-tied pair is the likeliest
    bias = torch.randn(vocab, generator=generator) * 0.1
    bias[1] = bias[0]
    rows = torch.randn(400, width, generator=generator)
    rows[:, :] += weight[0] / weight[0].norm()  # leaning towards the pair
    if first_pass == "Int8Linear":
        int8 = Int8Linear(weight, bias)
    else:
        int8 = Int8RowsLinear(weight, bias, kernels)
    head = RescoredHead(int8, weight, bias, num_rescored=num_rescored)
    with torch.inference_mode():
        exact = torch.nn.functional.linear(rows, weight, bias)
        approx, got = int8(rows), head(rows)
    assert (approx.argmax(1) != exact.argmax(1)).sum() > 0  # the flips this is about
    assert torch.equal(got.argmax(1), exact.argmax(1))
    top = approx.topk(num_rescored, dim=1).indices  # the rows the head recomputed
    assert torch.allclose(got.gather(1, top), exact.gather(1, top), rtol=0, atol=1e-4)
    tail = torch.ones_like(got, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(got[tail], approx[tail])


def test_engine_facts_and_hello_carry_the_quantization(llama_models, tmp_path):
    from pagoda.gpu_worker.server import WorkerServer

    for quantization in ("none", "int8"):
        engine = llama_models.engine(quantization=quantization)
        assert engine.facts.quantization == quantization
        assert engine.facts.numerics.startswith(f"{quantization}: ")
        assert "batch-invariant (" in engine.facts.numerics  # on the CPU
        server = WorkerServer(engine, f"ipc://{tmp_path}/w.sock")
        assert server.hello().quantization == quantization
        assert server.hello().numerics == engine.facts.numerics
    int8_facts = llama_models.engine(quantization="int8").facts.numerics
    assert "q_proj" in int8_facts and "down_proj" in int8_facts
    assert "per-token symmetric int8 (absmax / 127)" in int8_facts


def test_load_engine_resolves_auto_to_int8_on_the_cpu(llama_models):
    from pagoda.gpu_worker.config import parse_config
    from pagoda.gpu_worker.paged_engine import load_engine
    from pagoda.gpu_worker.quantization import count_int8_linear

    base = ["--model", str(llama_models.directory), "--num-kv-blocks", "8"]
    engine = load_engine(parse_config(base, {}))
    assert engine.facts.quantization == "int8" and count_int8_linear(engine.model) > 0
    exact = load_engine(parse_config([*base, "--quantization", "none"], {}))
    assert exact.facts.quantization == "none" and count_int8_linear(exact.model) == 0


@pytest.mark.parametrize(
    ("requested", "device", "dtype", "resolved"),
    [
        ("auto", "cpu", "auto", "int8"),
        ("auto", "cpu", "float32", "int8"),
        ("auto", "cpu", "bfloat16", "none"),
        ("auto", "cuda", "auto", "none"),
        ("auto", "cuda:1", "float32", "none"),
        ("none", "cpu", "auto", "none"),
        ("none", "cuda", "auto", "none"),
        ("int8", "cpu", "auto", "int8"),
    ],
)
def test_resolve_quantization(requested, device, dtype, resolved):
    from pagoda.gpu_worker.quantization import resolve_quantization

    assert resolve_quantization(requested, device, dtype) == resolved


@pytest.mark.parametrize(
    ("device", "dtype", "match"),
    [("cuda", "auto", "only on the CPU"), ("cpu", "bfloat16", "float32")],
)
def test_int8_is_refused_where_it_cannot_run(device, dtype, match):
    from pagoda.gpu_worker.quantization import QuantizationError, resolve_quantization

    with pytest.raises(QuantizationError, match=match):
        resolve_quantization("int8", device, dtype)


def test_config_flag_environment_and_toml(tmp_path):
    from pagoda.gpu_worker.config import describe, load_config, parse_config

    assert parse_config([], {}).quantization == "auto"
    assert parse_config(["--quantization", "none"], {}).quantization == "none"
    environ = {"PAGODA_WORKER_QUANTIZATION": "int8"}
    assert parse_config([], environ).quantization == "int8"
    assert parse_config(["--quantization", "none"], environ).quantization == "none"
    toml = tmp_path / "worker.toml"
    toml.write_text('quantization = "none"\n')
    loaded = load_config(["--config", str(toml)], {})
    assert loaded.config.quantization == "none"
    assert 'quantization = "none"' in describe(loaded)
    assert f"# toml {toml}" in next(
        line for line in describe(loaded).splitlines() if line.startswith("quantization")
    )


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--quantization", "int4"], {}, "invalid choice"),
        ([], {"PAGODA_WORKER_QUANTIZATION": "fp8"}, "--quantization must be one of"),
        (["--quantization", "int8", "--device", "cuda"], {}, "only on the CPU"),
        (["--quantization", "int8", "--dtype", "bfloat16"], {}, "float32 weights"),
    ],
)
def test_bad_quantization_exits_with_a_sentence(argv, environ, message, capsys):
    from pagoda.gpu_worker.config import parse_config

    with pytest.raises(SystemExit) as exited:
        parse_config(argv, environ)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
