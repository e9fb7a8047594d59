"""Several gRPC streams read as one, and the server-sent events written from them.

`fan_out` interleaves the chunks of a request's calls as they come; leaving it early (the
HTTP client went away: Starlette cancels the response task, or `until_disconnected` cancels
the handler's) cancels every call still running, so the scheduler frees their blocks before
it plans its next step. Its queue is bounded: a slow HTTP reader stops the gRPC reads, and
the scheduler's output slot coalesces the deltas meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from pagoda.client.async_client import AsyncChunkStream
from pagoda.client.errors import PagodaError
from pagoda.client.results import Chunk
from pagoda.openai_front.errors import FrontError, from_pagoda
from pagoda.openai_front.translation import Call

QUEUE_CHUNKS = 64
DONE_EVENT = "data: [DONE]\n\n"
T = TypeVar("T")
Events = AsyncIterator[tuple[Call, Chunk]]


class ClientGone(Exception):
    """The HTTP client disconnected before its response began."""


def sse(data: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event; `event` names its type (the Responses API's are typed)."""
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def replay(first: list[tuple[Call, Chunk]], events: Events) -> Events:
    """The chunks read before a stream began (`first`), then the rest of `events`."""
    for item in first:
        yield item
    async for item in events:
        yield item


async def fan_out(
    streams: list[tuple[Call, AsyncChunkStream]],
) -> AsyncIterator[tuple[Call, Chunk]]:
    """(call, chunk) pairs of all `streams` in arrival order; a failed call raises its
    FrontError. Closing the generator (or cancelling its reader) cancels every call."""
    if len(streams) == 1:  # the common case: no task, no queue
        call, stream = streams[0]
        try:
            async for chunk in stream:
                yield call, chunk
        except PagodaError as exc:
            raise from_pagoda(exc) from None
        finally:
            stream.cancel()
        return
    queue: asyncio.Queue[tuple[Call, Chunk | BaseException | None]] = asyncio.Queue(QUEUE_CHUNKS)

    async def pump(call: Call, stream: AsyncChunkStream) -> None:
        try:
            async for chunk in stream:
                await queue.put((call, chunk))
        except PagodaError as exc:
            await queue.put((call, from_pagoda(exc)))
            return
        await queue.put((call, None))

    tasks = [asyncio.create_task(pump(call, stream)) for call, stream in streams]
    try:
        running = len(tasks)
        while running:
            call, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield call, item
    finally:
        for task in tasks:
            task.cancel()
        for _, stream in streams:
            stream.cancel()


async def until_disconnected(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientGone) if the HTTP client disconnects
    first. `receive` is the request's ASGI receive, its body already read."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


def error_event(error: FrontError) -> str:
    """A failure after the stream began (the status line is long sent): an error event."""
    return sse(error.body())
