"""cache_salt at the edge (issue 14 item 12): its length limit, the API-key tenant salt,
the key file of several tenants and the --cache-salt-by-api-key setting."""

from __future__ import annotations

import pytest

from pagoda.protos import generation_pb2 as pb
from pagoda.scheduler_svc import settings
from pagoda.scheduler_svc.auth import read_api_keys, resolve_cache_salting, tenant_cache_salt
from pagoda.scheduler_svc.core.config import ConfigError
from pagoda.scheduler_svc.validation import (
    MAX_CACHE_SALT_BYTES,
    Limits,
    ValidationError,
    validate_generate,
)

LIMITS = Limits(
    max_context_tokens=100,
    vocab_size=1000,
    default_max_new_tokens=8,
    max_stop_strings=4,
    max_stop_string_bytes=8,
    max_logprobs=5,
)


def generate(cache_salt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]), cache_salt=cache_salt)


def test_cache_salt_is_kept_up_to_its_limit_and_refused_beyond():
    assert validate_generate(generate("tenant-a"), None, LIMITS).cache_salt == "tenant-a"
    assert validate_generate(generate(""), None, LIMITS).cache_salt == ""
    longest = "é" * (MAX_CACHE_SALT_BYTES // 2)  # 2 bytes each: the limit is in bytes
    assert validate_generate(generate(longest), None, LIMITS).cache_salt == longest
    with pytest.raises(ValidationError, match=f"cache_salt must be at most {MAX_CACHE_SALT_BYTES}"):
        validate_generate(generate(longest + "x"), None, LIMITS)


def test_tenant_salt_separates_keys_and_keeps_the_requests_own_salt():
    a, b = "Bearer key-a", "Bearer key-b"
    assert tenant_cache_salt(a, "") == tenant_cache_salt(a, "")
    assert tenant_cache_salt(a, "") != tenant_cache_salt(b, "")
    assert tenant_cache_salt(a, "x") != tenant_cache_salt(a, "")
    assert tenant_cache_salt(a, "x") != tenant_cache_salt(b, "x")
    assert "key-a" not in tenant_cache_salt(a, "x")  # a digest, never the key
    # A tenant cannot pick a salt that lands in another tenant's cache: the salts of
    # all requests of key b start with b's digest, whatever a's own salt says.
    assert not tenant_cache_salt(a, tenant_cache_salt(b, "")).startswith(tenant_cache_salt(b, ""))


def test_api_key_file_holds_one_key_per_line(tmp_path):
    path = tmp_path / "keys"
    path.write_text("key-a\n\n# tenant b\nkey-b  \n")
    assert read_api_keys(str(path)) == ["key-a", "key-b"]
    path.write_text("only-key\n")  # the old one-key file
    assert read_api_keys(str(path)) == ["only-key"]
    path.write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_api_keys(str(path))


def test_cache_salt_by_api_key_flag_env_and_toml(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k\n")
    loaded, _ = settings.load(["--cache-salt-by-api-key", "--api-key-file", str(keys)], {})
    assert loaded.config.cache_salt_by_api_key
    environ = {"PAGODA_CACHE_SALT_BY_API_KEY": "true", "PAGODA_API_KEY_FILE": str(keys)}
    assert settings.load([], environ)[0].config.cache_salt_by_api_key
    toml = tmp_path / "pagoda.toml"
    toml.write_text(f'cache_salt_by_api_key = true\napi_key_file = "{keys}"\n')
    assert settings.load(["--config", str(toml)], {})[0].config.cache_salt_by_api_key
    assert not settings.load([], {})[0].config.cache_salt_by_api_key
    with pytest.raises(ConfigError, match="cache_salt_by_api_key needs api_key_file"):
        settings.load(["--cache-salt-by-api-key"], {})


def test_chat_requests_carry_their_cache_salt_too(default_model_dir):
    from pagoda.scheduler_svc.chat_validation import validate_chat
    from pagoda.scheduler_svc.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    request = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="hi")], cache_salt="tenant-c"
    )
    assert validate_chat(request, tokenizer, LIMITS).cache_salt == "tenant-c"
    request.cache_salt = "x" * (MAX_CACHE_SALT_BYTES + 1)
    with pytest.raises(ValidationError, match="cache_salt"):
        validate_chat(request, tokenizer, LIMITS)


def test_several_keys_salt_the_cache_by_key_unless_told_otherwise(tmp_path):
    """Security review N9: with several tenants and no setting, B read A's cached prefix."""
    keys = tmp_path / "keys"
    keys.write_text("key-a\nkey-b\n")
    one_key = tmp_path / "one-key"
    one_key.write_text("key-a\n")

    def salted(argv: list[str]) -> bool:
        return resolve_cache_salting(settings.load(argv, {})[0].config).cache_salt_by_api_key

    assert salted(["--api-key-file", str(keys)])
    assert not salted(["--api-key-file", str(one_key)])
    assert not salted([])
    assert not salted(["--api-key-file", str(keys), "--no-cache-salt-by-api-key"])
    assert salted(["--api-key-file", str(one_key), "--cache-salt-by-api-key"])
