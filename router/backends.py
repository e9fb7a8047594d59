"""The scheduler replicas behind the router: a channel to each, its health as its own
grpc.health.v1 reports it, and the requests the router has in flight there.

A replica is routed to only while it says SERVING (a scheduler does so only while a
worker is attached), and not after it refused a call UNAVAILABLE until it says so again.
When it says NOT_SERVING, refuses a call, or cannot be reached, what the router believed
of its prefix cache is dropped (`cache_lost`): a scheduler that lost its worker dropped
its cache too. A check that merely timed out (a busy replica) keeps the belief.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.client.connection import RECONNECT_OPTIONS
from pagoda.common.listener import MIN_SEND_MESSAGE_BYTES

log = logging.getLogger("pagoda.router")

SERVING = health_pb2.HealthCheckResponse.SERVING
# A health check may take this long even when checks are more frequent.
MIN_CHECK_TIMEOUT_S = 1.0

# Reconnect quickly to a replica that restarts, as the client does (client/connection.py);
# replies as large as a scheduler may send; a ping every 45 s, answered within 20 s, so a
# replica whose host vanished without closing its connections ends its streams (a
# scheduler refuses pings more often than every 30 s).
CHANNEL_OPTIONS: tuple[tuple[str, str | int], ...] = (
    ("grpc.primary_user_agent", "pagoda-router"),
    ("grpc.keepalive_time_ms", 45_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    *RECONNECT_OPTIONS,
    ("grpc.max_receive_message_length", MIN_SEND_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MIN_SEND_MESSAGE_BYTES),
)


@dataclass(slots=True)
class Backend:
    """One replica. `in_flight` counts requests (a call's n samples) the router has open
    there, `num_refused` the calls it refused UNAVAILABLE; the event loop owns every field."""

    address: str
    channel: grpc.aio.Channel
    serving: bool = False
    # Whether the last change to not serving means its prefix cache is gone.
    cache_lost: bool = False
    in_flight: int = 0
    num_refused: int = 0
    watcher: asyncio.Task | None = field(default=None, repr=False)


class Backends:
    """Opened inside the serving event loop (grpc.aio channels belong to their loop).
    `on_change(backend)` is called whenever a backend starts or stops serving."""

    def __init__(
        self,
        addresses: list[str],
        credentials: grpc.ChannelCredentials | None,
        health_interval_s: float,
        on_change: Callable[[Backend], None],
    ) -> None:
        self._credentials = credentials
        self._interval_s = health_interval_s
        self._on_change = on_change
        self._started = False
        self._closing: set[asyncio.Task] = set()  # channels of removed replicas, draining
        self.by_address: dict[str, Backend] = {}
        for address in addresses:
            self.by_address[address] = Backend(address, self._open_channel(address))

    @property
    def all(self) -> list[Backend]:
        return list(self.by_address.values())

    def serving(self) -> list[Backend]:
        return [backend for backend in self.by_address.values() if backend.serving]

    def start(self) -> None:
        self._started = True
        for backend in self.by_address.values():
            self._start_watch(backend)

    def add(self, address: str) -> Backend:
        """A new replica: not serving until its first health check says so."""
        backend = self.by_address[address] = Backend(address, self._open_channel(address))
        if self._started:
            self._start_watch(backend)
        return backend

    def remove(self, address: str, drain_timeout_s: float) -> Backend:
        """Route nothing more to the replica; its calls in flight go on, and its channel
        closes once they end (cut after drain_timeout_s)."""
        backend = self.by_address.pop(address)
        if backend.watcher is not None:
            backend.watcher.cancel()
        if backend.serving:
            self._set(backend, False, cache_lost=True)
        task = asyncio.create_task(backend.channel.close(grace=drain_timeout_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return backend

    async def close(self) -> None:
        for backend in self.by_address.values():
            if backend.watcher is not None:
                backend.watcher.cancel()
        for backend in self.by_address.values():
            await backend.channel.close()
        await asyncio.gather(*self._closing, return_exceptions=True)

    def _open_channel(self, address: str) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(address, self._credentials, options=CHANNEL_OPTIONS)

    def _start_watch(self, backend: Backend) -> None:
        backend.watcher = asyncio.create_task(self._watch(backend), name=f"watch {backend.address}")

    def refused(self, backend: Backend) -> None:
        """A call there was refused UNAVAILABLE: not serving until its health says so again
        (the next check, within one interval)."""
        backend.num_refused += 1
        self._set(backend, False, cache_lost=True)

    async def _watch(self, backend: Backend) -> None:
        """Ask the replica's health every `interval_s`, for good. A health Check, not a
        Watch stream: a scheduler with API keys answers Check without a key, and only it."""
        stub = health_pb2_grpc.HealthStub(backend.channel)
        request = health_pb2.HealthCheckRequest(service="")
        while True:
            try:
                reply = await stub.Check(
                    request, timeout=max(self._interval_s, MIN_CHECK_TIMEOUT_S)
                )
                serving = reply.status == SERVING
                cache_lost = True
            except grpc.aio.AioRpcError as exc:
                if backend.serving:
                    log.warning(
                        "%s did not answer its health check: %s", backend.address, exc.code()
                    )
                serving = False
                cache_lost = exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED
            self._set(backend, serving, cache_lost=cache_lost)
            await asyncio.sleep(self._interval_s)

    def _set(self, backend: Backend, serving: bool, *, cache_lost: bool) -> None:
        if serving == backend.serving:
            return
        backend.serving = serving
        backend.cache_lost = not serving and cache_lost
        log.info("%s is %s", backend.address, "serving" if serving else "not serving")
        self._on_change(backend)
