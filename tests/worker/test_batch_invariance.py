"""Batch invariance, the numeric contract of every shipped CPU path (STYLE.md habit 18): a
request's tokens and logprobs are the same alone, inside any batch of any composition,
prefilled in one step or in chunks, and after a recompute. Token-exact and bit-exact:
logprobs are compared with ==, so a row whose logits moved by one ulp fails."""

from __future__ import annotations

import copy
import random

import pytest

from pagoda.gpu_worker.quantization import count_q4_linear
from pagoda.protos import step_pb2
from tests.worker.conftest import TEST_BLOCK_SIZE, TEST_NUM_BLOCKS, TinyModels, random_prompts
from tests.worker.toy_scheduler import Job, ToyScheduler, split_into

NUM_NEW_TOKENS = 12
NUM_TRIALS = 4
TARGET = 1000  # the request under test; batch mates have ids below it


def sampling(seed: int | None) -> step_pb2.SamplingParams:
    """Greedy (seed None) or seeded nucleus sampling; both ask for logprobs."""
    if seed is None:
        return step_pb2.SamplingParams(
            temperature=0.0, top_p=1.0, repetition_penalty=1.0, num_logprobs=3
        )
    return step_pb2.SamplingParams(
        temperature=0.9, top_p=0.95, top_k=40, repetition_penalty=1.0, seed=seed, num_logprobs=3
    )


def traced(scheduler: ToyScheduler, seq_id: int) -> tuple[list[int], list[float], list[float]]:
    """(tokens, sampled logprobs, top logprobs) of `seq_id` over the steps run so far."""
    return traced_entries(
        scheduler,
        [
            (step, entry)
            for step, result in enumerate(scheduler.results)
            for entry, sampled_id in enumerate(result.seq_ids)
            if sampled_id == seq_id
        ],
    )


def traced_entries(
    scheduler: ToyScheduler, entries: list[tuple[int, int]]
) -> tuple[list[int], list[float], list[float]]:
    """(tokens, sampled logprobs, top logprobs) of the results' (step, entry) `entries`."""
    tokens: list[int] = []
    logprobs: list[float] = []
    top: list[float] = []
    for step, entry in entries:
        result = scheduler.results[step]
        tokens.append(result.token_ids[entry])
        logprobs.append(result.logprobs[entry])
        start, end = result.top_offsets[entry], result.top_offsets[entry + 1]
        top.extend(result.top_logprobs[start:end])
    return tokens, logprobs, top


def alone(models: TinyModels, quantization: str, backend: str, prompt: list[int], seed: int | None):
    scheduler = ToyScheduler(
        models.engine(quantization=quantization, attention_backend=backend),
        num_blocks=TEST_NUM_BLOCKS,
        block_size=TEST_BLOCK_SIZE,
    )
    scheduler.add(TARGET, prompt, sampling=sampling(seed))
    scheduler.run(NUM_NEW_TOKENS)
    return traced(scheduler, TARGET)


def in_a_random_batch(
    models: TinyModels,
    quantization: str,
    backend: str,
    prompt: list[int],
    seed: int | None,
    rng,
) -> tuple[list[int], list[float], list[float]]:
    """The target among 1-7 random batch mates (greedy and sampled, admitted at random
    steps, some chunked), its own prompt cut into 1-4 random chunks; half of the trials
    preempt it mid-stream and recompute it from scratch."""
    scheduler = ToyScheduler(
        models.engine(quantization=quantization, attention_backend=backend),
        num_blocks=TEST_NUM_BLOCKS,
        block_size=TEST_BLOCK_SIZE,
        seed=rng.randrange(1000),
    )
    add_random_mates(scheduler, rng)
    scheduler.add(
        TARGET,
        prompt,
        sampling=sampling(seed),
        chunk_sizes=split_into(len(prompt), rng.randint(1, 4), rng),
        admit_at_step=rng.randint(0, 4),
    )
    if rng.random() < 0.5:
        scheduler.run(rng.randint(2, NUM_NEW_TOKENS - 2))
        job = scheduler.recompute(TARGET, TARGET + 1)
        job.chunk_sizes = split_into(len(job.known), rng.randint(1, 3), rng)
        before = traced(scheduler, TARGET)
        scheduler.run(NUM_NEW_TOKENS)
        after = traced(scheduler, TARGET + 1)
        # The recompute step samples the token after the generated ones: the stream goes on.
        return tuple(b + a for b, a in zip(before, after, strict=True))
    scheduler.run(NUM_NEW_TOKENS)
    return traced(scheduler, TARGET)


def add_random_mates(scheduler: ToyScheduler, rng) -> list[Job]:
    """1-7 random batch mates (greedy and sampled, admitted at random steps over the
    first 7, some chunked), with ids below TARGET."""
    return [
        scheduler.add(
            mate,
            mate_prompt,
            sampling=sampling(rng.choice([None, rng.randrange(100)])),
            chunk_sizes=split_into(len(mate_prompt), rng.randint(1, 3), rng),
            admit_at_step=rng.randint(0, 6),
        )
        for mate, mate_prompt in enumerate(
            random_prompts(rng.randint(1, 7), seed=rng.randrange(1000), max_len=60)
        )
    ]


_Q4_MODELS: dict[int, TinyModels] = {}


def q4_1_version(models: TinyModels) -> TinyModels:
    """`models` with the decoder's Linear weights rounded to Q4_1 (as the default model's
    GGUF holds them), so that int8 runs them as Q4Linear, the default's path; one per
    architecture, kept for the session."""
    import torch

    from pagoda.gpu_worker.quantization import round_to_q4_1

    if id(models) not in _Q4_MODELS:
        reference = copy.deepcopy(models.reference)
        head = reference.get_output_embeddings()
        with torch.no_grad():
            for module in reference.modules():
                if isinstance(module, torch.nn.Linear) and module is not head:
                    module.weight.copy_(round_to_q4_1(module.weight))
                elif type(module).__name__ == "Conv1D":  # GPT-2's, stored [in, out]
                    module.weight.copy_(round_to_q4_1(module.weight.t()).t())
        _Q4_MODELS[id(models)] = TinyModels(None, reference)
    return _Q4_MODELS[id(models)]


def models_under_test(
    tiny_models: TinyModels, quantization: str, weights: str, backend: str
) -> TinyModels:
    """The models to run for one case of the parametrization below (skips when the cpu
    backend cannot run here), checked to take the path the case names."""
    models = tiny_models
    if backend == "cpu":
        from pagoda.gpu_worker import cpu_kernels

        if cpu_kernels.load() is None:
            pytest.skip("Pagoda's CPU kernels cannot be built or run here")
        config = models.reference.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // (
            config.num_attention_heads
        )
        assert head_dim % 8 == 0, "the kernel would not run: the reference would be tested"
    if weights == "q4_1":
        models = q4_1_version(tiny_models)
        engine = models.engine(quantization=quantization, attention_backend=backend)
        assert count_q4_linear(engine.model) > 0, "the Q4_1 path is not exercised"
        assert engine.facts.batch_invariant  # what the hello tells the scheduler
        if backend == "cpu" and tiny_models.reference.config.model_type == "llama":
            # elementwise.c's RMSNorm, SiLU*up and RoPE (fused_model.py) are in this path
            assert "RMSNorm, SiLU*up and RoPE: Pagoda's" in engine.facts.numerics
    return models


# Every shipped CPU path: both attention backends, float and int8 weights, and the Q4_1
# weights that int8 runs as the default model's GGUF path.
PATHS = pytest.mark.parametrize(
    ("quantization", "weights"),
    [("none", "float"), ("int8", "float"), ("int8", "q4_1")],
    ids=["none", "int8", "int8-q4_1"],
)
BACKENDS = pytest.mark.parametrize("backend", ["reference", "cpu"])
SEEDS = pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])


def case_alone(
    tiny_models: TinyModels, quantization: str, weights: str, seed: int | None, backend: str,
    label: str = "",
):  # fmt: skip
    """One case of PATHS x SEEDS x BACKENDS: its models, a generator named by `label` and
    the case, a random prompt of 20-45 tokens, and what that prompt gives alone."""
    models = models_under_test(tiny_models, quantization, weights, backend)
    rng = random.Random(f"{label}{quantization}-{weights}-{seed}")
    (prompt,) = random_prompts(1, seed=rng.randrange(1000), min_len=20, max_len=45)
    return models, rng, prompt, alone(models, quantization, backend, prompt, seed)


@PATHS
@SEEDS
@BACKENDS
def test_a_request_is_the_same_alone_in_any_batch_chunked_and_recomputed(
    tiny_models, quantization, weights, seed, backend
):
    models, rng, prompt, expected = case_alone(tiny_models, quantization, weights, seed, backend)
    assert len(expected[0]) == NUM_NEW_TOKENS
    for trial in range(NUM_TRIALS):
        got = in_a_random_batch(models, quantization, backend, prompt, seed, rng)
        assert got[0] == expected[0], f"trial {trial}: tokens differ"
        assert got[1:] == expected[1:], f"trial {trial}: same tokens, other logprobs"
