"""The asyncio client: the same methods as `Client`, over grpc.aio."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.client import convert
from pagoda.client.connection import (
    DEFAULT_TARGET,
    READY_CHECK_TIMEOUT_S,
    READY_POLL_INTERVAL_S,
    ConnectionSettings,
)
from pagoda.client.convert import GenerationOptions, Message
from pagoda.client.errors import DeadlineExceededError, error_from_rpc
from pagoda.client.results import Chunk, Completion, ModelInfo, ServerStats
from pagoda.protos import generation_pb2, generation_pb2_grpc


class AsyncChunkStream(AsyncIterator[Chunk]):
    """The chunks of one Generate or Chat stream, for `async for`.

    Breaking out of the loop (dropping the stream), `cancel()`, `aclose()`, leaving an
    `async with` block, or cancelling the task that awaits a chunk cancels a still-running
    RPC, so the server frees the request. Errors raise PagodaError subclasses.
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._done = False
        self._cancelled = False

    async def __anext__(self) -> Chunk:
        if self._done:
            raise StopAsyncIteration
        try:
            response = await self._call.read()
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._cancelled and current is not None and not current.cancelling():
                # Our own cancel() ended the read, not a cancellation of this task.
                raise StopAsyncIteration from None
            self.cancel()
            raise
        except grpc.RpcError as exc:
            self._done = True
            if self._cancelled:
                raise StopAsyncIteration from None
            raise error_from_rpc(exc) from None
        if response is grpc.aio.EOF:
            self._done = True
            raise StopAsyncIteration
        return convert.chunk_from_response(response)

    def cancel(self) -> None:
        """Cancel the RPC if it is still running; later iteration ends the stream."""
        if not self._done:
            self._cancelled = True
            self._done = True
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncChunkStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        if hasattr(self, "_call"):
            self.cancel()


class AsyncClient:
    """An asyncio client of pagoda.v1.Generation; see `Client` for the arguments.

    The channel is opened on first use, inside the running event loop, and belongs to that
    loop. Close it with `await close()` or `async with`.
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
        self._channel: grpc.aio.Channel | None = None
        self._stub: generation_pb2_grpc.GenerationStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None

    @property
    def target(self) -> str:
        return self._settings.target

    def generate(
        self, prompt: str | Sequence[int], **options: Unpack[GenerationOptions]
    ) -> AsyncChunkStream:
        """Stream the generation for a text prompt or a list of prompt token ids."""
        request = convert.generate_request(prompt, **options)
        return AsyncChunkStream(self._stubs()[0].Generate(request, **self._call_kwargs()))

    def chat(
        self,
        messages: Iterable[Message],
        **options: Unpack[GenerationOptions],
    ) -> AsyncChunkStream:
        """Stream the assistant's answer to `messages` ({"role", "content"} dicts or pairs;
        an assistant's calls of tools and the tools' answers as `convert.Message` says).

        With `tools=`, the last chunk may carry the model's calls (`Chunk.tool_calls`,
        finish_reason "tool_calls"); `tool_choice=` and `parallel_tool_calls=` steer them.
        `stream_tool_calls=True` also streams each call as the model writes it, in pieces
        (`Chunk.tool_call_deltas`: the first with its id and name, then its arguments' text).
        A model that thinks (`ModelInfo.thinks`) streams its thinking in
        `Chunk.reasoning_text`, before the answer in `Chunk.text`.
        `chat_template_kwargs=` (a dict, sent as JSON) gives the chat template extra
        variables, e.g. {"enable_thinking": False} for Qwen3 to answer without thinking.
        """
        request = convert.chat_request(messages, **options)
        return AsyncChunkStream(self._stubs()[0].Chat(request, **self._call_kwargs()))

    async def complete(
        self, prompt: str | Sequence[int], **options: Unpack[GenerationOptions]
    ) -> Completion:
        """Generate and wait for the whole text (of one sample: see complete_samples)."""
        if options.get("n", 1) not in (0, 1):
            raise TypeError("complete() returns one sample; complete_samples() returns n")
        async with self.generate(prompt, **options) as stream:
            return convert.join_chunks([chunk async for chunk in stream])

    async def complete_samples(
        self, prompt: str | Sequence[int], **options: Unpack[GenerationOptions]
    ) -> list[Completion]:
        """Generate `n` samples (an option, default 1) and wait for them all, by index."""
        async with self.generate(prompt, **options) as stream:
            return convert.join_samples([chunk async for chunk in stream])

    async def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        request = convert.tokenize_request(text, add_special_tokens=add_special_tokens)
        response = await self._unary(self._stubs()[0].Tokenize, request)
        return convert.token_ids_from_response(response)

    async def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool = False
    ) -> str:
        request = convert.detokenize_request(token_ids, skip_special_tokens=skip_special_tokens)
        response = await self._unary(self._stubs()[0].Detokenize, request)
        return response.text

    async def model_info(self) -> ModelInfo:
        request = generation_pb2.ModelInfoRequest()
        response = await self._unary(self._stubs()[0].GetModelInfo, request)
        return convert.model_info_from_proto(response)

    async def server_stats(self) -> ServerStats:
        request = generation_pb2.ServerStatsRequest()
        response = await self._unary(self._stubs()[0].GetServerStats, request)
        return convert.server_stats_from_proto(response)

    async def wait_ready(self, timeout_s: float) -> None:
        """Return once grpc.health.v1 reports SERVING; DeadlineExceededError after timeout_s."""
        health = self._stubs()[1]
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
                response = await health.Check(
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
            await asyncio.sleep(min(READY_POLL_INTERVAL_S, max(deadline - time.monotonic(), 0)))

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = self._health = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _stubs(self) -> tuple[generation_pb2_grpc.GenerationStub, health_pb2_grpc.HealthStub]:
        if self._stub is None or self._health is None:
            self._channel = self._settings.open_channel()
            self._stub = generation_pb2_grpc.GenerationStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        return self._stub, self._health

    def _call_kwargs(self) -> dict[str, Any]:
        return {"metadata": self._settings.metadata, "timeout": self._settings.timeout_s}

    async def _unary(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, **self._call_kwargs())
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
