"""A request's routing key: what of it a replica's prefix cache would hold, read from the
request's bytes (the router forwards those bytes unchanged; this parse only reads them).

The key is the text the prompt begins with, in the order the scheduler will tokenize it:
a Generate's prompt (or its token ids), a Chat's tools and then its messages in turn (a
chat template renders them in that order, each message behind its role). It is opened by
a seed naming the caller's tenant and cache salt: the scheduler salts its cache by them
(`cache_salt`, and the API key with --cache-salt-by-api-key), so two tenants' equal
prompts need not meet on one replica.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from pagoda.protos import generation_pb2
from pagoda.router.prefix_index import IDS_CHUNK_TOKENS, TEXT_CHUNK_CHARS, chunk_hashes

# Between the parts of a chat key: characters no template renders between a role and its
# content, so a message's end cannot pass for a longer message's middle.
_PART = "\x1e"
_FIELD = "\x1f"


@dataclass(frozen=True, slots=True)
class RoutingKey:
    chunk_hashes: list[int]
    # Requests this call adds to its backend's load (its `n` samples, at least 1).
    weight: int
    # The client's own request_id ("" for none).
    request_id: str


def generate_key(data: bytes, tenant: str) -> RoutingKey | None:
    """None when the bytes do not parse: the backend answers those with its own error."""
    try:
        request = generation_pb2.GenerateRequest.FromString(data)
    except DecodeError:
        return None
    seed = ("generate", tenant, request.cache_salt)
    if request.WhichOneof("input") == "prompt_token_ids":
        hashes = chunk_hashes(list(request.prompt_token_ids.ids), IDS_CHUNK_TOKENS, seed)
    else:
        hashes = chunk_hashes(request.prompt, TEXT_CHUNK_CHARS, seed)
    return RoutingKey(hashes, max(1, request.n), request.request_id)


def chat_key(data: bytes, tenant: str) -> RoutingKey | None:
    try:
        request = generation_pb2.ChatRequest.FromString(data)
    except DecodeError:
        return None
    parts = [_FIELD.join((tool.name, tool.description, tool.parameters)) for tool in request.tools]
    parts.extend(_message_text(message) for message in request.messages)
    seed = ("chat", tenant, request.cache_salt)
    hashes = chunk_hashes(_PART.join(parts), TEXT_CHUNK_CHARS, seed)
    return RoutingKey(hashes, max(1, request.n), request.request_id)


def tenant_of(metadata: Sequence[tuple[str, str | bytes]]) -> str:
    """A digest of the caller's bearer key ("" without one): its tenant, never the key."""
    for name, value in metadata:
        if name == "authorization":
            raw = value if isinstance(value, bytes) else value.encode()
            return hashlib.blake2b(raw, digest_size=8).hexdigest()
    return ""


def _message_text(message: generation_pb2.ChatMessage) -> str:
    calls = _FIELD.join(f"{call.name}{_FIELD}{call.arguments}" for call in message.tool_calls)
    return _FIELD.join((message.role, message.name, message.content, calls))
