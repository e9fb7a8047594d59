"""A request's routing key, read from its bytes: prompts that share a beginning share
chunks; tenants and cache salts never do; bytes that do not parse have no key."""

from __future__ import annotations

from pagoda.protos import generation_pb2 as pb
from pagoda.router.routing_key import chat_key, generate_key, tenant_of

SYSTEM = "You are a careful assistant. " * 10  # several 64-character chunks


def chat(*turns: tuple[str, str], **fields) -> bytes:
    messages = [pb.ChatMessage(role=role, content=content) for role, content in turns]
    return pb.ChatRequest(messages=messages, **fields).SerializeToString()


def test_chats_with_one_system_prompt_share_its_chunks():
    a = chat_key(chat(("system", SYSTEM), ("user", "What is 2 + 2?")), tenant="")
    b = chat_key(chat(("system", SYSTEM), ("user", "Name a colour.")), tenant="")
    shared = len(SYSTEM) // 64
    assert a.chunk_hashes[:shared] == b.chunk_hashes[:shared]


def test_a_conversation_that_goes_on_extends_its_key():
    first = chat_key(chat(("system", SYSTEM), ("user", "Hello " * 20)), tenant="")
    later = chat_key(
        chat(("system", SYSTEM), ("user", "Hello " * 20), ("assistant", "Hi"), ("user", "More")),
        tenant="",
    )
    assert later.chunk_hashes[: len(first.chunk_hashes)] == first.chunk_hashes


def test_tenants_and_cache_salts_share_nothing():
    request = chat(("system", SYSTEM))
    salted = chat(("system", SYSTEM), cache_salt="s")
    plain = chat_key(request, tenant="")
    assert not set(plain.chunk_hashes) & set(chat_key(request, tenant="t").chunk_hashes)
    assert not set(plain.chunk_hashes) & set(chat_key(salted, tenant="").chunk_hashes)


def test_a_generate_key_reads_text_or_ids_its_weight_and_request_id():
    text = pb.GenerateRequest(prompt=SYSTEM, n=3, request_id="r").SerializeToString()
    key = generate_key(text, tenant="")
    assert (len(key.chunk_hashes), key.weight, key.request_id) == (len(SYSTEM) // 64, 3, "r")
    ids = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=list(range(40))))
    key = generate_key(ids.SerializeToString(), tenant="")
    assert (len(key.chunk_hashes), key.weight) == (2, 1)


def test_bytes_that_do_not_parse_have_no_key():
    assert generate_key(b"\xff\xff\xff", tenant="") is None
    assert chat_key(b"\x0a\x05ab", tenant="") is None


def test_the_tenant_is_a_digest_of_the_key_never_the_key():
    tenant = tenant_of((("authorization", "Bearer secret-key"),))
    assert tenant and "secret" not in tenant
    assert tenant == tenant_of((("authorization", b"Bearer secret-key"),))
    assert tenant_of(()) == ""
