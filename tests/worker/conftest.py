"""Worker test factories: a reference model and paged engines over the same weights."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pagoda.common import step_codec
from pagoda.protos import step_pb2

# Small blocks so every prompt crosses several block boundaries.
TEST_BLOCK_SIZE = 4
TEST_NUM_BLOCKS = 512
NUM_NEW_TOKENS = 24


def diversify(model, seed: int = 0, std: float = 0.2) -> None:
    """Redraw every weight matrix with a larger spread.

    The conftest models keep transformers' tiny init, under which greedy decoding
    repeats one token whatever the context: a wrong mask or position would still
    "match". With std 0.2 each token depends on its context.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


def run_plan(engine, plan: step_pb2.StepPlan) -> step_pb2.StepResult:
    """One step the way the server runs it: decode the message, step, encode the result."""
    return step_codec.encode_result(engine.step(step_codec.decode_plan(plan)))


@dataclass
class TinyModels:
    """A reference model (stock attention) and a factory of paged engines on copies of it."""

    directory: Path | None  # None: built in memory by the test
    reference: object
    _greedy_cache: dict = field(default_factory=dict)

    def engine(self, **kwargs):
        from pagoda.gpu_worker.paged_engine import PagedEngine

        kwargs.setdefault("num_kv_blocks", TEST_NUM_BLOCKS)
        kwargs.setdefault("block_size", TEST_BLOCK_SIZE)
        return PagedEngine(copy.deepcopy(self.reference), model_id="tiny", **kwargs)

    def greedy(self, prompt: list[int], num_new_tokens: int = NUM_NEW_TOKENS) -> list[int]:
        """model.generate() of one unpadded prompt, greedy, not stopping at EOS."""
        import torch

        key = (tuple(prompt), num_new_tokens)
        if key not in self._greedy_cache:
            input_ids = torch.tensor([prompt])
            output = self.reference.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=num_new_tokens,
            )
            self._greedy_cache[key] = output[0, len(prompt) :].tolist()
        return self._greedy_cache[key]


@pytest.fixture(scope="session")
def tiny_models(tiny_model_dir) -> TinyModels:
    """Per architecture (llama, qwen2, gpt2): reference model + engine factory."""
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    diversify(reference)
    # The engine never stops a sequence (the scheduler does): neither may the reference.
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 0
    return TinyModels(tiny_model_dir, reference)


@pytest.fixture(scope="session")
def llama_models(tiny_model_factory) -> TinyModels:
    import transformers

    directory = tiny_model_factory("llama")
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    diversify(reference)
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 0
    return TinyModels(directory, reference)


def random_prompts(count: int, seed: int, min_len: int = 3, max_len: int = 40) -> list[list[int]]:
    """Prompts of different lengths over the tiny vocabulary (ids 3..511: no special ids)."""
    rng = random.Random(seed)
    lengths = [min_len, max_len] + [rng.randint(min_len, max_len) for _ in range(count - 2)]
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths[:count]]
