"""The blocking client: `AsyncClient` driven from a private event loop on a thread of its own."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError
from typing import Unpack

import grpc

from pagoda.client.async_client import AsyncChunkStream, AsyncClient
from pagoda.client.connection import DEFAULT_TARGET
from pagoda.client.convert import GenerationOptions, Message
from pagoda.client.errors import RequestCancelledError
from pagoda.client.loop_thread import LoopThread
from pagoda.client.results import Chunk, Completion, ModelInfo, ServerStats


class ChunkStream(Iterator[Chunk]):
    """The chunks of one Generate or Chat stream, in order.

    The RPC runs until the last chunk arrives. Breaking out of a loop over the stream (so that
    it is dropped), `close()`, or leaving a `with` block cancels a still-running RPC, so the
    server frees the request. Errors raise PagodaError subclasses.
    """

    def __init__(self, stream: AsyncChunkStream, loop: LoopThread) -> None:
        self._stream = stream
        self._loop = loop
        self._ended = False

    def __next__(self) -> Chunk:
        if self._ended:
            raise StopIteration
        try:
            return self._loop.run(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None
        except CancelledError:
            # The client was closed under the stream (grpc's own words for it).
            self._ended = True
            raise RequestCancelledError(
                grpc.StatusCode.CANCELLED, "Stream removed (Channel closed!)"
            ) from None

    def cancel(self) -> None:
        """Cancel the RPC if it is still running; later iteration ends the stream."""
        self._ended = True
        # Ordered before any later `__next__`: both go through the loop's one queue.
        self._loop.call_soon(self._stream.cancel)

    close = cancel

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        if hasattr(self, "_loop"):
            self.cancel()


class Client:
    """A blocking client of pagoda.v1.Generation.

    `timeout_s` is the deadline of every call, a whole stream included (None: no deadline).
    `api_key` is sent as `authorization: Bearer <key>`; `tls_root_cert` (PEM) turns on TLS.
    Thread-safe: every call runs on the client's own event loop thread, which owns the channel
    (an `AsyncClient`). Close it (or use it as a context manager) to release both.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        tls_root_cert: bytes | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self._client = AsyncClient(
            target, api_key=api_key, tls_root_cert=tls_root_cert, timeout_s=timeout_s
        )
        self._loop = LoopThread("pagoda client")
        # A client dropped without close() still stops its thread, as a dropped channel closes.
        self._close = weakref.finalize(self, _close, self._loop, self._client)

    @property
    def target(self) -> str:
        return self._client.target

    def generate(
        self, prompt: str | Sequence[int], **options: Unpack[GenerationOptions]
    ) -> ChunkStream:
        """Stream the generation for a text prompt or a list of prompt token ids."""
        return self._open(lambda: self._client.generate(prompt, **options))

    def chat(
        self,
        messages: Iterable[Message],
        **options: Unpack[GenerationOptions],
    ) -> ChunkStream:
        """Stream the assistant's answer to `messages`: the messages and options, tools,
        streamed calls and thinking as AsyncClient.chat says."""
        return self._open(lambda: self._client.chat(messages, **options))

    def complete(
        self, prompt: str | Sequence[int], **options: Unpack[GenerationOptions]
    ) -> Completion:
        """Generate and wait for the whole text (of one sample: see complete_samples)."""
        return self._loop.run(self._client.complete(prompt, **options))

    def complete_samples(
        self, prompt: str | Sequence[int], **options: Unpack[GenerationOptions]
    ) -> list[Completion]:
        """Generate `n` samples (an option, default 1) and wait for them all, by index."""
        return self._loop.run(self._client.complete_samples(prompt, **options))

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self._loop.run(self._client.tokenize(text, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._loop.run(
            self._client.detokenize(token_ids, skip_special_tokens=skip_special_tokens)
        )

    def model_info(self) -> ModelInfo:
        return self._loop.run(self._client.model_info())

    def server_stats(self) -> ServerStats:
        return self._loop.run(self._client.server_stats())

    def wait_ready(self, timeout_s: float) -> None:
        """Return once grpc.health.v1 reports SERVING; DeadlineExceededError after timeout_s."""
        self._loop.run(self._client.wait_ready(timeout_s))

    def close(self) -> None:
        self._close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open(self, open_stream: Callable[[], AsyncChunkStream]) -> ChunkStream:
        """Start a stream on the loop: a grpc.aio call belongs to the loop it starts in."""

        async def opened() -> AsyncChunkStream:
            return open_stream()

        return ChunkStream(self._loop.run(opened()), self._loop)


def _close(loop: LoopThread, client: AsyncClient) -> None:
    loop.stop(client.close())
