"""The int8 forward on the real default model keeps its quality: the gate of
`python -m benchmarks.quantization --check quality`, same prompts and lengths (figures in
docs/benchmarks.md, "int8 forward")."""

from __future__ import annotations

import pytest

from benchmarks.quantization import (
    BLOCK_SIZE,
    agreement,
    chat_prompts,
    greedy_batch,
    score_text,
    text_token_ids,
    top1_agreement,
)
from pagoda.gpu_worker.model_loader import load_model, resolve_model_dir
from pagoda.gpu_worker.quantization import quantize

# 64 prompts x 48 tokens, float32 and int8: about 2 minutes on 2 quiet cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

NUM_PROMPTS = 64
NUM_NEW_TOKENS = 48
# llama-server's mean first divergence from float32 on these prompts, same Q4_1 weights
# (`python -m benchmarks.quantization --check quality` measures it when the binary is built).
LLAMA_SERVER_DIVERGENCE = 24.5


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def runs(default_model_dir, tokenizer):
    """(text scores, greedy tokens) of the float and the int8 model, same inputs."""
    from pagoda.gpu_worker.paged_engine import PagedEngine

    resolved = resolve_model_dir("default")
    prompts = chat_prompts(tokenizer, NUM_PROMPTS)
    num_blocks = sum(-(-(len(p) + NUM_NEW_TOKENS) // BLOCK_SIZE) for p in prompts)
    text_ids = text_token_ids(tokenizer)
    measured = {}
    for quantization in ("none", "int8"):
        model = quantize(load_model(resolved, "cpu"), quantization)
        scores = score_text(model, text_ids)  # before the engine: stock attention
        engine = PagedEngine(
            model, model_id=resolved.model_id, num_kv_blocks=num_blocks, block_size=BLOCK_SIZE
        )
        measured[quantization] = (scores, greedy_batch(engine, prompts, NUM_NEW_TOKENS))
    return measured


def test_int8_perplexity_stays_within_1_percent_of_float(runs):
    # Measured -0.44% (per-token int8 weights and activations: +0.41%; 7-bit activations
    # with one scale per call before issue 26: +3.1%).
    exact, approx = runs["none"][0], runs["int8"][0]
    assert abs(approx.perplexity / exact.perplexity - 1) < 0.01, (exact, approx)


def test_int8_teacher_forced_top1_agrees_with_float(runs):
    # Measured 99.2% with the decoder as Q4Linear (per-token int8: 93.1%, capped at 96.1%
    # by its per-channel weights; docs/benchmarks.md).
    assert top1_agreement(runs["none"][0], runs["int8"][0]) >= 0.97


def test_int8_greedy_text_starts_as_the_float_model_s(runs):
    # Greedy chains part at the first near-tie and never meet again; measured over these
    # 64 prompts x 48 tokens: mean first divergence 40.0 (45/64 identical), llama-server
    # on the same Q4_1 weights 24.5 (per-token int8: 17.5).
    agree = agreement(runs["none"][1], runs["int8"][1])
    assert agree.mean_first_divergence >= LLAMA_SERVER_DIVERGENCE, agree
