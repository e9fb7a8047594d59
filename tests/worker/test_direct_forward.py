"""The CPU fast path's direct forward (gpu_worker/direct_forward.py) gives the model call's
logits bit for bit, step after step (prompts in chunks beside decodes, Llama and Qwen3),
and stands aside for any model it does not run whole."""

from __future__ import annotations

import copy

import pytest
import torch

from pagoda.gpu_worker import cpu_kernels
from pagoda.gpu_worker.direct_forward import DirectForward
from pagoda.gpu_worker.paged_engine import PagedEngine
from pagoda.gpu_worker.quantization import round_to_q4_1
from pagoda.protos import step_pb2
from tests.worker.conftest import random_prompts
from tests.worker.fused_models import tiny_model
from tests.worker.toy_scheduler import ToyScheduler

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="Pagoda's CPU kernels cannot be built or run here"
)

NUM_BLOCKS = 256
BLOCK_SIZE = 4


def q4_1_model(family: str):
    """A tiny `family` model whose decoder weights are exactly Q4_1 (the default model's
    kind), so that `int8` runs it on the Q4_1 kernel."""
    model = tiny_model(family)
    head = model.get_output_embeddings()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                module.weight.copy_(round_to_q4_1(module.weight))
    return model


def engine_of(model, **options) -> PagedEngine:
    options = {"quantization": "int8", "attention_backend": "cpu", **options}
    return PagedEngine(
        copy.deepcopy(model),
        model_id="tiny",
        num_kv_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        **options,
    )


def logits_of_each_step(engine: PagedEngine) -> list[torch.Tensor]:
    """Run a fixed workload (prompts in uneven chunks, admitted at different steps, then
    decoding side by side, greedy and seeded) and return each step's logits."""
    seen: list[torch.Tensor] = []
    sample = engine._sample

    def recorded(logits, *args, **kwargs):
        seen.append(logits.clone())
        return sample(logits, *args, **kwargs)

    engine._sample = recorded
    scheduler = ToyScheduler(engine, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, seed=1)
    seeded = step_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=5, num_logprobs=2)
    for seq_id, prompt in enumerate(random_prompts(4, seed=3, min_len=9, max_len=40)):
        scheduler.add(
            seq_id,
            prompt,
            chunk_sizes=[5, 7] if seq_id % 2 == 0 else [],  # step 0 samples nothing
            admit_at_step=seq_id,
            sampling=seeded if seq_id == 3 else None,
        )
    scheduler.run(12)
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_direct_forward_gives_the_model_calls_logits_bit_for_bit(family):
    model = q4_1_model(family)
    direct = engine_of(model)
    assert direct.direct is not None, "the direct forward does not take this model"
    through_modules = engine_of(model)
    through_modules.direct = None
    got, expected = logits_of_each_step(direct), logits_of_each_step(through_modules)
    assert len(got) == len(expected) > 12
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.shape == b.shape and torch.equal(a, b), f"step {step}"


def test_a_model_not_run_whole_on_the_kernels_goes_through_its_modules():
    model = q4_1_model("llama")
    assert engine_of(model, fused_ops=False).direct is None  # nothing patched
    assert engine_of(model, quantization="none").direct is None  # float32 Linear layers
    assert engine_of(tiny_model("llama")).direct is None  # not Q4_1: int8 layers


def test_a_part_it_does_not_know_is_refused_with_the_reason(caplog):
    engine = engine_of(q4_1_model("qwen3"))
    model = engine.model
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(96, 64)
    with caplog.at_level("INFO", logger="pagoda.worker.engine"):
        assert DirectForward.of(model, cpu_kernels.load()) is None
    assert "a projection is not on the Q4_1 kernel" in caplog.text
