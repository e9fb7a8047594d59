"""load_tokenizer on the real default model, the tiny test tokenizer, and odd templates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagoda.scheduler_svc.tokenizer import ChatTemplateError, TextTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir) -> TextTokenizer:
    return load_tokenizer(default_model_dir)


def test_the_default_models_special_tokens_and_sizes(default_tokenizer):
    assert default_tokenizer.eos_token_ids == frozenset({2})
    assert default_tokenizer.bos_token_id == 1
    assert default_tokenizer.vocab_size == 49152
    assert default_tokenizer.model_max_length == 8192
    assert default_tokenizer.token_bytes() is not None  # byte-level BPE: the fast path


def test_encode_decode_round_trip(default_tokenizer):
    text = "Paris is the capital of France. 日本 😀"
    ids = default_tokenizer.encode(text)
    assert default_tokenizer.decode(ids) == text
    assert default_tokenizer.id_to_piece(ids[1]) == "Ġis"


def test_render_chat_uses_the_models_template(default_tokenizer):
    rendered = default_tokenizer.render_chat([("user", "Hi")])
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert default_tokenizer.known_roles == {"system", "user", "assistant", "tool"}


def test_the_tiny_tokenizer_has_its_template_in_tokenizer_config(tiny_tokenizer_dir):
    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    assert tokenizer.render_chat([("user", "a"), ("assistant", "b")]) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token_ids == {tokenizer.tokenizer.token_to_id("<|im_end|>")}
    assert tokenizer.model_max_length is None


def copy_tiny(tiny_tokenizer_dir: Path, tmp_path: Path, **config_updates) -> Path:
    directory = tmp_path / "model"
    shutil.copytree(tiny_tokenizer_dir, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(config_updates)
    config_path.write_text(json.dumps(config))
    return directory


def test_a_template_that_refuses_a_role_does_not_know_it(tiny_tokenizer_dir, tmp_path):
    template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
        "[{{ m['role'] }}] {{ m['content'] | tojson }}\n{% endfor %}"
    )
    tokenizer = load_tokenizer(copy_tiny(tiny_tokenizer_dir, tmp_path, chat_template=template))
    assert tokenizer.known_roles == {"user", "assistant"}
    assert tokenizer.render_chat([("user", 'say "hi"')]) == '[user] "say \\"hi\\""\n'
    with pytest.raises(ChatTemplateError, match="unknown role system"):
        tokenizer.render_chat([("system", "x")])


def test_eos_ids_come_from_generation_config_config_and_the_eos_token(tiny_tokenizer_dir, tmp_path):
    directory = copy_tiny(tiny_tokenizer_dir, tmp_path)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    (directory / "config.json").write_text(json.dumps({"eos_token_id": 7, "n_positions": 256}))
    tokenizer = load_tokenizer(directory)
    im_end = tokenizer.tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.eos_token_ids == {5, 6, 7, im_end}
    assert tokenizer.model_max_length == 256


def test_no_template_and_no_tokenizer_json(tiny_tokenizer_dir, tmp_path):
    directory = copy_tiny(tiny_tokenizer_dir, tmp_path, chat_template=None)
    tokenizer = load_tokenizer(directory)
    assert tokenizer.known_roles == frozenset()
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.render_chat([("user", "x")])
    (directory / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(directory)
