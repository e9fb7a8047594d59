"""Prefix-cache isolation through real gRPC, scheduler and dummy worker processes (issue 14
item 12, security review M2): usage.cached_prompt_tokens counts only hits of the same
cache_salt, and under --cache-salt-by-api-key only the same API key's."""

from __future__ import annotations

import pytest

from pagoda.protos import generation_pb2
from tests.e2e.conftest import running_service

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
SECRET = [(13 * i) % 4000 + 10 for i in range(3 * BLOCK_SIZE + 5)]  # 3 full blocks


def cached_prompt_tokens(service, prompt, *, cache_salt: str = "", api_key: str | None = None):
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
        stopping=generation_pb2.StoppingCriteria(max_new_tokens=1, ignore_eos=True),
        cache_salt=cache_salt,
    )
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    with service.channel() as channel:
        responses = list(service.stub(channel).Generate(request, timeout=60, metadata=metadata))
    return responses[-1].usage.cached_prompt_tokens


def test_cached_prompt_tokens_only_within_a_salt(tmp_path):
    with running_service(tmp_path, model="dummy") as service:
        assert cached_prompt_tokens(service, SECRET, cache_salt="tenant-a") == 0
        assert cached_prompt_tokens(service, SECRET, cache_salt="tenant-b") == 0
        assert cached_prompt_tokens(service, SECRET) == 0  # unsalted
        assert cached_prompt_tokens(service, SECRET, cache_salt="tenant-a") == 3 * BLOCK_SIZE
        assert cached_prompt_tokens(service, SECRET, cache_salt="tenant-b") == 3 * BLOCK_SIZE
        assert cached_prompt_tokens(service, SECRET) == 3 * BLOCK_SIZE
        with service.channel() as channel, pytest.raises(Exception) as refused:
            request = generation_pb2.GenerateRequest(
                prompt_token_ids=generation_pb2.TokenIds(ids=[5]), cache_salt="s" * 257
            )
            list(service.stub(channel).Generate(request, timeout=30))
        assert refused.value.code().name == "INVALID_ARGUMENT"
        assert "cache_salt" in refused.value.details()


# Several keys salt by key by default (security review N9); the flag says so explicitly.
@pytest.mark.parametrize("flag", [[], ["--cache-salt-by-api-key"]], ids=["default", "flag"])
def test_cache_salt_by_api_key_keeps_tenants_apart(tmp_path, flag):
    keys = tmp_path / "api-keys"
    keys.write_text("key-a\nkey-b\n")
    keys.chmod(0o600)
    scheduler_args = ["--api-key-file", str(keys), *flag]
    with running_service(tmp_path, model="dummy", scheduler_args=scheduler_args) as service:
        assert cached_prompt_tokens(service, SECRET, api_key="key-a") == 0
        # Tenant b sends the same prompt: no hit, the oracle of review M2 is gone.
        assert cached_prompt_tokens(service, SECRET, api_key="key-b") == 0
        assert cached_prompt_tokens(service, SECRET, api_key="key-a") == 3 * BLOCK_SIZE
        assert cached_prompt_tokens(service, SECRET, api_key="key-b") == 3 * BLOCK_SIZE
        # Within a tenant, its own salts still split its cache.
        assert cached_prompt_tokens(service, SECRET, api_key="key-a", cache_salt="x") == 0
        assert cached_prompt_tokens(service, SECRET, api_key="key-a", cache_salt="x") == 48
        # A request of tenant b that names tenant a's salt is still tenant b's.
        assert cached_prompt_tokens(service, SECRET, api_key="key-b", cache_salt="x") == 0
