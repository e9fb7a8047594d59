"""The router's Generation service: each call forwarded, as bytes, to one replica.

Generate and Chat go where the policy says (router/policy.py), their routing key read
from the request; GetServerStats asks every replica and adds their answers up
(router/stats.py); every other unary call goes to the least loaded replica. What a
replica answers (messages, status, details, trailing metadata) reaches the client
unchanged; the router decides nothing about a request's validity, so every refusal is the
scheduler's own sentence.

A call that a replica refuses with UNAVAILABLE (no worker attached, or unreachable) before
any message reached the client is tried on the next replica: nothing was streamed, and a
greedy or seeded request gives the same tokens on any replica, so no client can tell. After
the first message a call stays where it is; a replica lost then ends the stream with its
error, as a lost connection to a scheduler would.

A client's `request_id` names its request within its own connection; every client reaches
a replica through the router's one connection, so the router scopes the id by the client's
peer before forwarding it and gives the client back its own id in each reply.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from pagoda.protos import generation_pb2
from pagoda.router.backends import Backend, Backends
from pagoda.router.policy import Route, Thresholds, cache_aware, least_loaded, round_robin
from pagoda.router.prefix_index import PrefixIndex
from pagoda.router.routing_key import RoutingKey, chat_key, generate_key, tenant_of
from pagoda.router.stats import merge_stats
from pagoda.scheduler_svc.write_watch import StalledWrite, WriteWatch, end_stalled

log = logging.getLogger("pagoda.router")

SERVICE = "pagoda.v1.Generation"
# Metadata that belongs to one hop (HTTP/2 pseudo-headers, gRPC's own, the transport's),
# never forwarded; every other entry (the bearer key first) is.
_HOP_PREFIXES = (":", "grpc-")
_HOP_KEYS = frozenset({"user-agent", "te", "content-type", "host", "connection"})


@dataclass(frozen=True, slots=True)
class RouterSettings:
    policy: str = "cache-aware"
    thresholds: Thresholds = Thresholds()
    max_cached_chunks_per_backend: int = 1 << 20
    stream_write_timeout_s: float = 60.0
    health_interval_s: float = 0.5


class NoBackend(Exception):
    """No replica is serving (or every one was tried)."""


class Router:
    """Opened inside the serving event loop; `on_serving(bool)` hears when the router starts
    or stops having a serving replica (its own health follows it)."""

    def __init__(
        self,
        addresses: list[str],
        credentials: grpc.ChannelCredentials | None,
        settings: RouterSettings,
        on_serving: Callable[[bool], None],
    ) -> None:
        self._settings = settings
        self._on_serving = on_serving
        self._index = PrefixIndex(addresses, settings.max_cached_chunks_per_backend)
        self._backends = Backends(
            addresses, credentials, settings.health_interval_s, self._backend_changed
        )
        self._write_watch = WriteWatch(settings.stream_write_timeout_s)
        self._turn = 0
        # Calls routed, by (replica, reason); read by the metrics.
        self.num_routes: Counter[tuple[str, str]] = Counter()

    @property
    def backends(self) -> list[Backend]:
        return self._backends.all

    def num_cached_chunks(self, address: str) -> int:
        return self._index.num_chunks(address)

    def start(self) -> None:
        self._backends.start()

    def set_backends(self, addresses: list[str], drain_timeout_s: float) -> None:
        """Route to these replicas from now on: new ones are health-checked and join once
        serving; removed ones get no new call, and their calls in flight go on (cut after
        drain_timeout_s)."""
        current = {backend.address for backend in self._backends.all}
        for address in [a for a in current if a not in addresses]:
            self._backends.remove(address, drain_timeout_s)
            self._index.remove(address)
            log.info("%s removed: no new calls; its calls in flight go on", address)
        for address in [a for a in addresses if a not in current]:
            self._index.add(address)
            self._backends.add(address)
            log.info("%s added: routed to once its health says SERVING", address)

    async def close(self) -> None:
        self._write_watch.close()
        await self._backends.close()

    def handler(self) -> grpc.GenericRpcHandler:
        """The Generation service over raw bytes: nothing is parsed on the way but the
        routing key, nothing re-encoded but a scoped request_id."""
        return _GenerationHandler(self)

    # The calls.

    async def generate(self, data: bytes, context) -> None:
        metadata = forwarded_metadata(context.invocation_metadata())
        key = generate_key(data, tenant_of(metadata))
        await self._stream("Generate", generation_pb2.GenerateRequest, data, key, metadata, context)

    async def chat(self, data: bytes, context) -> None:
        metadata = forwarded_metadata(context.invocation_metadata())
        key = chat_key(data, tenant_of(metadata))
        await self._stream("Chat", generation_pb2.ChatRequest, data, key, metadata, context)

    async def server_stats(self, data: bytes, context) -> bytes | None:
        metadata = forwarded_metadata(context.invocation_metadata())
        timeout_s = context.time_remaining()

        async def ask(backend: Backend) -> bytes:
            call = backend.channel.unary_unary(_path("GetServerStats"))
            return await call(data, metadata=metadata, timeout=timeout_s)

        backends = self._backends.all
        replies = await asyncio.gather(*(ask(b) for b in backends), return_exceptions=True)
        answers = [reply for reply in replies if isinstance(reply, bytes)]
        if not answers:
            error = next(r for r in replies if isinstance(r, grpc.aio.AioRpcError))
            _end_with(context, error.code(), error.details(), error.trailing_metadata())
            return None
        if len(answers) < len(backends):
            failed = [
                b.address
                for b, r in zip(backends, replies, strict=True)
                if not isinstance(r, bytes)
            ]
            log.info("GetServerStats: no answer from %s; summing the others", ", ".join(failed))
        return merge_stats(answers)

    # Routing.

    def route(self, key: RoutingKey | None, tried: Sequence[Backend]) -> Backend:
        """The replica for a call with this key (None: any), among those serving and not
        yet tried; its key is then recorded as cached there."""
        candidates = [b for b in self._backends.serving() if b not in tried]
        if not candidates:
            raise NoBackend
        by_address = {b.address: b for b in candidates}
        names = list(by_address)
        loads = {b.address: b.in_flight for b in candidates}
        cached = {name: self._index.num_chunks(name) for name in names}
        if key is None or self._settings.policy == "least-loaded":
            chosen = Route(least_loaded(names, loads, cached), "least-loaded")
        elif self._settings.policy == "round-robin":
            chosen = round_robin(names, self._turn)
            self._turn += 1
        else:
            matched = self._index.matched_chunks(key.chunk_hashes)
            chosen = cache_aware(
                names, loads, matched, len(key.chunk_hashes), cached, self._settings.thresholds
            )
        backend = by_address[chosen.backend]
        if key is not None:
            self._index.record(backend.address, key.chunk_hashes)
        self.num_routes[backend.address, chosen.reason] += 1
        log.debug("routed to %s (%s)", backend.address, chosen.reason)
        return backend

    def _backend_changed(self, backend: Backend) -> None:
        if backend.cache_lost:
            # A scheduler that stops serving lost its worker (and the worker's cache) or is
            # going away: whatever the router believed cached there is gone.
            self._index.forget(backend.address)
        self._on_serving(bool(self._backends.serving()))

    # Forwarding.

    async def _stream(self, name, request_class, data, key, metadata, context) -> None:
        weight = key.weight if key is not None else 1
        client_id = key.request_id if key is not None else ""
        if client_id:
            data += request_class(request_id=f"{context.peer()}/{client_id}").SerializeToString()
        tried: list[Backend] = []
        refusal: grpc.aio.AioRpcError | None = None
        while True:
            try:
                backend = self.route(key, tried)
            except NoBackend:
                break
            tried.append(backend)
            backend.in_flight += weight
            call = backend.channel.unary_stream(_path(name))(
                data, metadata=metadata, timeout=context.time_remaining()
            )
            forwarded_any = False
            try:
                async for reply in call:
                    if client_id:
                        reply = _with_request_id(reply, client_id)
                    forwarded_any = True
                    await self._write_watch.write(context.write(reply))
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNAVAILABLE and not forwarded_any:
                    self._backends.refused(backend)
                    refusal = error
                    log.info(
                        "%s from %s: %s; trying another", name, backend.address, error.details()
                    )
                    continue
                _end_with(context, error.code(), error.details(), error.trailing_metadata())
                return
            except StalledWrite:
                sentence = self._write_watch.stalled_sentence
                await end_stalled(context, grpc.StatusCode.DEADLINE_EXCEEDED, sentence)
            except grpc.aio.InternalError:
                # grpc refused the write: the client's connection closed while it waited.
                # The call is over, like a cancel; nothing is left to answer.
                return
            finally:
                backend.in_flight -= weight
                call.cancel()  # a no-op once the call ended; else the client left or stalled
            _end_with(
                context, await call.code(), await call.details(), await call.trailing_metadata()
            )
            return
        self._end_unavailable(context, refusal)

    async def unary(self, name: str, data: bytes, context) -> bytes | None:
        """Any other unary call, to the least loaded replica."""
        metadata = forwarded_metadata(context.invocation_metadata())
        tried: list[Backend] = []
        refusal: grpc.aio.AioRpcError | None = None
        while True:
            try:
                backend = self.route(None, tried)
            except NoBackend:
                break
            tried.append(backend)
            backend.in_flight += 1
            try:
                call = backend.channel.unary_unary(_path(name))
                return await call(data, metadata=metadata, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as error:
                refusal = error
            finally:
                backend.in_flight -= 1
            if refusal.code() != grpc.StatusCode.UNAVAILABLE:
                _end_with(context, refusal.code(), refusal.details(), refusal.trailing_metadata())
                return None
            self._backends.refused(backend)
        self._end_unavailable(context, refusal)
        return None

    def _end_unavailable(self, context, refusal: grpc.aio.AioRpcError | None) -> None:
        """No replica could take the call: the last one's own refusal when every serving
        one refused it, else the router's sentence (none was serving)."""
        if refusal is not None:
            _end_with(context, refusal.code(), refusal.details(), refusal.trailing_metadata())
            return
        sentence = f"no replica is serving ({len(self._backends.all)} configured)"
        _end_with(context, grpc.StatusCode.UNAVAILABLE, sentence, None)


class _GenerationHandler(grpc.GenericRpcHandler):
    """Every method of pagoda.v1.Generation: Generate and Chat routed by their prompt,
    GetServerStats summed, and any other method (Tokenize, Detokenize, GetModelInfo, and
    unary methods of a newer proto than the router's) forwarded to the least loaded
    replica, which answers UNIMPLEMENTED for a method it does not have."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def service(self, handler_call_details):
        service, _, name = handler_call_details.method.lstrip("/").partition("/")
        if service != SERVICE:
            return None
        router = self._router
        if name == "Generate":
            return grpc.unary_stream_rpc_method_handler(router.generate)
        if name == "Chat":
            return grpc.unary_stream_rpc_method_handler(router.chat)
        if name == "GetServerStats":
            return grpc.unary_unary_rpc_method_handler(router.server_stats)
        method = _METHODS.get(name)
        if method is not None and (method.server_streaming or method.client_streaming):
            return None  # a stream the router does not know how to route: UNIMPLEMENTED

        async def forward(data: bytes, context) -> bytes:
            return await router.unary(name, data, context)

        return grpc.unary_unary_rpc_method_handler(forward)


_METHODS = generation_pb2.DESCRIPTOR.services_by_name["Generation"].methods_by_name


def forwarded_metadata(metadata) -> tuple[tuple[str, str | bytes], ...]:
    return tuple(
        (name, value)
        for name, value in metadata or ()
        if not name.startswith(_HOP_PREFIXES) and name not in _HOP_KEYS
    )


def _path(name: str) -> str:
    return f"/{SERVICE}/{name}"


def _with_request_id(reply: bytes, request_id: str) -> bytes:
    response = generation_pb2.GenerateResponse.FromString(reply)
    response.request_id = request_id
    return response.SerializeToString()


def _end_with(context, code: grpc.StatusCode, details: str | None, trailing) -> None:
    """End the call with a status by setting it, never by context.abort: abort's exception,
    raised in a handler's frame, would keep the request's bytes alive in a reference cycle
    until the collector runs (as scheduler_svc/refusals.py explains)."""
    if trailing:
        context.set_trailing_metadata(tuple(trailing))
    if code != grpc.StatusCode.OK:
        context.set_code(code)
        context.set_details(details or "")
