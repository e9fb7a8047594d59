"""The blocking client: one gRPC channel, every Generation RPC, and readiness polling."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagoda.client import convert
from pagoda.client.connection import (
    CHANNEL_OPTIONS,
    DEFAULT_TARGET,
    READY_CHECK_TIMEOUT_S,
    READY_POLL_INTERVAL_S,
    ConnectionSettings,
)
from pagoda.client.convert import GenerationOptions
from pagoda.client.errors import DeadlineExceededError, error_from_rpc
from pagoda.client.results import Chunk, Completion, ModelInfo, ServerStats
from pagoda.protos import generation_pb2, generation_pb2_grpc


class ChunkStream(Iterator[Chunk]):
    """The chunks of one Generate or Chat stream, in order.

    The RPC runs until the last chunk arrives. Breaking out of a loop over the stream (so that
    it is dropped), `close()`, or leaving a `with` block cancels a still-running RPC, so the
    server frees the request. Errors raise PagodaError subclasses.
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._done = False
        self._cancelled = False

    def __next__(self) -> Chunk:
        if self._done:
            raise StopIteration
        try:
            response = next(self._call)
        except StopIteration:
            self._done = True
            raise
        except grpc.RpcError as exc:
            self._done = True
            if self._cancelled:
                raise StopIteration from None
            raise error_from_rpc(exc) from None
        return convert.chunk_from_response(response)

    def cancel(self) -> None:
        """Cancel the RPC if it is still running; later iteration ends the stream."""
        if not self._done:
            self._cancelled = True
            self._done = True
            self._call.cancel()

    close = cancel

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        if hasattr(self, "_call"):
            self.cancel()


class Client:
    """A blocking client of pagoda.v1.Generation.

    `timeout_s` is the deadline of every call, a whole stream included (None: no deadline).
    `api_key` is sent as `authorization: Bearer <key>`; `tls_root_cert` (PEM) turns on TLS.
    Thread-safe; close it (or use it as a context manager) to release the channel.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        tls_root_cert: bytes | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self._settings = ConnectionSettings(target, api_key, tls_root_cert, timeout_s)
        credentials = self._settings.credentials
        options = list(CHANNEL_OPTIONS)
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=options)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @property
    def target(self) -> str:
        return self._settings.target

    def generate(
        self, prompt: str | Sequence[int], **options: Unpack[GenerationOptions]
    ) -> ChunkStream:
        """Stream the generation for a text prompt or a list of prompt token ids."""
        request = convert.generate_request(prompt, **options)
        return ChunkStream(self._stub.Generate(request, **self._call_kwargs()))

    def chat(
        self,
        messages: Iterable[Mapping[str, str] | Sequence[str]],
        **options: Unpack[GenerationOptions],
    ) -> ChunkStream:
        """Stream the assistant's answer to `messages` ({"role", "content"} dicts or pairs)."""
        request = convert.chat_request(messages, **options)
        return ChunkStream(self._stub.Chat(request, **self._call_kwargs()))

    def complete(
        self, prompt: str | Sequence[int], **options: Unpack[GenerationOptions]
    ) -> Completion:
        """Generate and wait for the whole text."""
        with self.generate(prompt, **options) as stream:
            return convert.join_chunks(stream)

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        request = convert.tokenize_request(text, add_special_tokens=add_special_tokens)
        return convert.token_ids_from_response(self._unary(self._stub.Tokenize, request))

    def model_info(self) -> ModelInfo:
        response = self._unary(self._stub.GetModelInfo, generation_pb2.ModelInfoRequest())
        return convert.model_info_from_proto(response)

    def server_stats(self) -> ServerStats:
        response = self._unary(self._stub.GetServerStats, generation_pb2.ServerStatsRequest())
        return convert.server_stats_from_proto(response)

    def wait_ready(self, timeout_s: float) -> None:
        """Return once grpc.health.v1 reports SERVING; DeadlineExceededError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        last_seen = "no answer"
        while True:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise DeadlineExceededError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the server at {self.target} was not SERVING within {timeout_s:g} s "
                    f"(last seen: {last_seen})",
                )
            try:
                response = self._health.Check(
                    health_pb2.HealthCheckRequest(service=""),
                    timeout=min(remaining_s, READY_CHECK_TIMEOUT_S),
                    metadata=self._settings.metadata,
                    wait_for_ready=True,
                )
            except grpc.RpcError as exc:
                last_seen = str(error_from_rpc(exc))
            else:
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last_seen = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            time.sleep(min(READY_POLL_INTERVAL_S, max(deadline - time.monotonic(), 0)))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call_kwargs(self) -> dict[str, Any]:
        return {"metadata": self._settings.metadata, "timeout": self._settings.timeout_s}

    def _unary(self, method: Any, request: Any) -> Any:
        try:
            return method(request, **self._call_kwargs())
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
