"""The front's one gRPC edge: a channel to the scheduler's public API, shared by every HTTP
request, each call carrying its own caller's bearer key.

Requests are built and chunks read by the project's client (`client.convert`,
`AsyncChunkStream`), so a field is spelled and a status mapped in one place; what this
module adds is the per-call metadata, which the client fixes per channel.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.client import convert
from pagoda.client.async_client import AsyncChunkStream
from pagoda.client.connection import ConnectionSettings
from pagoda.client.errors import error_from_rpc
from pagoda.client.results import ModelInfo
from pagoda.openai_front.errors import FrontError
from pagoda.openai_front.translation import Call
from pagoda.protos import generation_pb2, generation_pb2_grpc

# The served model changes only when the scheduler restarts with another one.
MODEL_INFO_TTL_S = 5.0
HEALTH_TIMEOUT_S = 2.0
_BEARER = "bearer "
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def call_metadata(
    authorization: str | None, traceparent: str | None = None
) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata for an HTTP `Authorization` header (the same bearer key, or none)
    and a W3C `traceparent` header (passed on, so the scheduler's access log names the
    caller's trace).

    A header that is not `Bearer <key>` sends no key (the scheduler then refuses the call
    when it has keys); a key gRPC cannot carry (not printable ASCII) is a 401 here. A
    traceparent that is not printable ASCII of its length is dropped.
    """
    metadata: tuple[tuple[str, str], ...] = ()
    if traceparent is not None and _TRACEPARENT.fullmatch(traceparent.strip()):
        metadata = (("traceparent", traceparent.strip()),)
    if authorization is None or not authorization.lower().startswith(_BEARER):
        return metadata
    key = authorization[len(_BEARER) :].strip()
    if not key or not key.isascii() or not key.isprintable():
        raise FrontError(
            401, "the bearer key is malformed", "invalid_request_error", None, "invalid_api_key"
        )
    return (("authorization", f"Bearer {key}"), *metadata)


@dataclass(slots=True)
class _CachedModelInfo:
    info: ModelInfo
    fetched_at_s: float


class Upstream:
    """Opened inside the serving event loop (grpc.aio channels belong to their loop)."""

    def __init__(self, target: str, tls_root_cert: bytes | None) -> None:
        self._target = target
        self._tls_root_cert = tls_root_cert
        self._channel: grpc.aio.Channel | None = None
        self._stub: generation_pb2_grpc.GenerationStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None
        self._model_info: _CachedModelInfo | None = None

    @property
    def target(self) -> str:
        return self._target

    def open(self) -> None:
        # The client's channel (options and TLS); the bearer key travels per call instead.
        self._channel = ConnectionSettings(
            self._target, tls_root_cert=self._tls_root_cert
        ).open_channel()
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = self._health = None

    def stream(self, call: Call, metadata: tuple[tuple[str, str], ...]) -> AsyncChunkStream:
        """Start one Generate or Chat call; cancelling or dropping the stream cancels it."""
        if call.messages is not None:
            request = convert.chat_request(call.messages, **call.options)
            return AsyncChunkStream(self._generation().Chat(request, metadata=metadata))
        request = convert.generate_request(call.prompt, **call.options)
        return AsyncChunkStream(self._generation().Generate(request, metadata=metadata))

    async def model_info(
        self, metadata: tuple[tuple[str, str], ...], *, fresh: bool = False
    ) -> ModelInfo:
        """GetModelInfo, cached for MODEL_INFO_TTL_S unless `fresh`."""
        now_s = time.monotonic()
        cached = self._model_info
        if not fresh and cached is not None and now_s - cached.fetched_at_s < MODEL_INFO_TTL_S:
            return cached.info
        reply = await self._unary(
            self._generation().GetModelInfo, generation_pb2.ModelInfoRequest(), metadata
        )
        info = convert.model_info_from_proto(reply)
        self._model_info = _CachedModelInfo(info, now_s)
        return info

    async def tokenize(
        self, text: str, add_special_tokens: bool, metadata: tuple[tuple[str, str], ...]
    ) -> generation_pb2.TokenizeResponse:
        request = generation_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return await self._unary(self._generation().Tokenize, request, metadata)

    async def detokenize(
        self, token_ids: list[int], metadata: tuple[tuple[str, str], ...]
    ) -> generation_pb2.DetokenizeResponse:
        request = convert.detokenize_request(token_ids)
        return await self._unary(self._generation().Detokenize, request, metadata)

    async def _unary(self, method, request, metadata: tuple[tuple[str, str], ...]):
        try:
            return await method(request, metadata=metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    async def serving(self) -> bool:
        """Whether the scheduler's grpc.health.v1 says SERVING (it needs no key)."""
        if self._health is None:
            return False
        try:
            reply = await self._health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _generation(self) -> generation_pb2_grpc.GenerationStub:
        if self._stub is None:
            raise RuntimeError("Upstream.open() was not called")
        return self._stub
