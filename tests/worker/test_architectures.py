"""Beyond the three conftest architectures: the paged attention keeps the library's model
code, so sliding windows (Mistral), logit soft-capping and alternating window layers
(Gemma 2), fused projections (Phi-3), and QK-norm (Qwen3) match generate() too."""

from __future__ import annotations

import random

import pytest

from tests.worker.conftest import TinyModels, diversify
from tests.worker.toy_scheduler import ToyScheduler, split_into

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Windows far shorter than the prompts + 12 generated tokens, and a soft cap small
# enough to bite: each feature changes the tokens when it is left out.
EXTRA = {
    "MistralConfig": dict(sliding_window=6),
    "Gemma2Config": dict(
        head_dim=16,
        sliding_window=4,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
    ),
    "Phi3Config": {},
    "Qwen3Config": dict(head_dim=16),
}


def architecture_model(config_name: str):
    """A tiny random-weight model of one EXTRA architecture, fp32, greedy without EOS."""
    import torch
    import transformers

    config = getattr(transformers, config_name)(**COMMON, **EXTRA[config_name])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    diversify(model)
    if config_name.startswith("Gemma"):
        # Gemma scales embeddings by sqrt(hidden_size) and ties them to the head: large
        # embeddings make the residual stream echo the input token whatever attention does.
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("config_name", sorted(EXTRA))
def test_architecture_matches_generate(config_name):
    models = TinyModels(None, architecture_model(config_name))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 9, 20, 14)]
    scheduler = ToyScheduler(models.engine(num_kv_blocks=128), num_blocks=128, block_size=4)
    for seq_id, prompt in enumerate(prompts):
        chunks = split_into(len(prompt), 3, rng)
        scheduler.add(seq_id, prompt, chunk_sizes=chunks, admit_at_step=seq_id)
    tokens = scheduler.run(12)
    assert tokens == {seq_id: models.greedy(p, 12) for seq_id, p in enumerate(prompts)}
