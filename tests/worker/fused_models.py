"""Tiny Llama and Qwen3 models for the fused dense ops' tests (test_fused_ops.py with the
Triton kernels, test_cpu_fused_ops.py with the CPU kernels): two layers, random weights,
norms that are not ones."""

from __future__ import annotations

import torch

TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def tiny_model(family: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A "llama" (llama3 RoPE scaling) or "qwen3" (head_dim 32, q/k norms) model, eval."""
    import transformers

    torch.manual_seed(0)
    if family == "qwen3":
        config = transformers.Qwen3Config(**TINY, head_dim=32)
    else:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}  # fmt: skip
        config = transformers.LlamaConfig(**TINY, rope_parameters=rope)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).to(device, dtype).eval()
    with torch.no_grad():  # the norms are ones at init: make them matter
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) / 4)
    return model
