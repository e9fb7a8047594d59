"""One mapping from grpc.StatusCode to PagodaError subclasses, used by both clients."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest

from pagoda.client import AsyncClient, Client
from pagoda.client.errors import (
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    PagodaError,
    RequestCancelledError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    error_from_rpc,
)
from pagoda.protos import generation_pb2

EXPECTED_CLASSES = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: RequestCancelledError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.UNIMPLEMENTED: PagodaError,
}


class StubRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code", list(EXPECTED_CLASSES))
def test_error_from_rpc_maps_each_code(code):
    error = error_from_rpc(StubRpcError(code, "The queue is full."))
    assert type(error) is EXPECTED_CLASSES[code]
    assert error.code is code and error.details == "The queue is full."
    assert str(error) == f"{code.name}: The queue is full."


def test_error_without_details_still_has_a_sentence():
    error = error_from_rpc(StubRpcError(grpc.StatusCode.UNAVAILABLE, None))
    assert error.details and "UNAVAILABLE" in error.details


def test_a_bare_rpc_error_becomes_unknown():
    assert error_from_rpc(grpc.RpcError()).code is grpc.StatusCode.UNKNOWN


# Codes the fake server can be asked for; CANCELLED from the server (e.g. while draining) is
# an error to the client, unlike the client's own cancellation, which just ends the stream.
SERVER_CODES = [c for c in EXPECTED_CLASSES if c is not grpc.StatusCode.UNIMPLEMENTED]


@pytest.mark.parametrize("code", SERVER_CODES)
def test_sync_client_raises_the_mapped_class(fake_server, code):
    with Client(fake_server.target) as client:
        with pytest.raises(EXPECTED_CLASSES[code]) as info:
            list(client.generate(f"error:{code.name}"))
        assert info.value.code is code and "asked to fail" in info.value.details
        with pytest.raises(EXPECTED_CLASSES[code]):
            client.complete(f"error-after:{code.name}")


@pytest.mark.parametrize("code", SERVER_CODES)
def test_async_client_raises_the_mapped_class(fake_server, code):
    async def scenario():
        async with AsyncClient(fake_server.target) as client:
            with pytest.raises(EXPECTED_CLASSES[code]) as info:
                await client.complete(f"error:{code.name}")
            assert info.value.code is code
            with pytest.raises(EXPECTED_CLASSES[code]):
                async for _ in client.chat([("user", f"error-after:{code.name}")]):
                    pass

    asyncio.run(scenario())


def test_unreachable_server_is_unavailable():
    # Port 1 on loopback refuses connections.
    with Client("127.0.0.1:1", timeout_s=5) as client, pytest.raises(UnavailableError):
        client.model_info()


# --- a stream cut off before its status -------------------------------------------------
# grpc's sentences for an HTTP/2 stream that ended without trailers, as grpcio 1.85 words
# them: what a proxy sends when the replica behind it went away mid-stream (HAProxy 2.6:
# an empty DATA frame with END_STREAM; others reset the stream).
CUT_OFF = {
    "end-stream": (grpc.StatusCode.UNKNOWN, "Stream removed (Data frame with END_STREAM flag received)"),
    "rst-internal": (grpc.StatusCode.INTERNAL, "Stream removed (RST_STREAM (Received RST_STREAM with error code 2))"),
    "rst-no-error": (grpc.StatusCode.INTERNAL, "Stream removed (RST_STREAM (Received RST_STREAM with error code 0))"),
}  # fmt: skip


@pytest.mark.parametrize("how", list(CUT_OFF))
def test_a_stream_cut_off_before_its_status_is_unavailable(how):
    """A transport failure, as a reset connection is: retryable UNAVAILABLE, not a server
    error (the Pagoda client raised InternalError for it, the front answered 500)."""
    code, details = CUT_OFF[how]
    error = error_from_rpc(StubRpcError(code, details))
    assert type(error) is UnavailableError
    assert error.code is grpc.StatusCode.UNAVAILABLE
    assert details in error.details  # grpc's own words stay


@pytest.mark.parametrize(
    "code, details",
    [
        (grpc.StatusCode.UNKNOWN, "Exception iterating responses: boom"),
        (grpc.StatusCode.INTERNAL, "the worker failed on this request twice"),
        (grpc.StatusCode.INTERNAL, "the scheduler says: Stream removed"),
    ],
)
def test_a_status_the_server_sent_keeps_its_class(code, details):
    assert type(error_from_rpc(StubRpcError(code, details))) is InternalError


@contextmanager
def cutting_server(how: str) -> Iterator[str]:
    """A raw HTTP/2 server on loopback that answers every call with its response headers,
    one GenerateResponse, then ends the stream without trailers (`how`)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    stopping = threading.Event()
    message = generation_pb2.GenerateResponse(token_ids=[7, 8]).SerializeToString()

    def answer(connection: h2.connection.H2Connection, stream_id: int) -> None:
        headers = [(":status", "200"), ("content-type", "application/grpc")]
        connection.send_headers(stream_id, headers)
        connection.send_data(stream_id, b"\0" + len(message).to_bytes(4, "big") + message)
        if how == "end-stream":
            connection.send_data(stream_id, b"", end_stream=True)
        else:
            reason = "INTERNAL_ERROR" if how == "rst-internal" else "NO_ERROR"
            connection.reset_stream(stream_id, h2.errors.ErrorCodes[reason])

    def serve_connection(sock: socket.socket) -> None:
        connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        connection.initiate_connection()
        sock.sendall(connection.data_to_send())
        while not stopping.is_set():
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                return
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    answer(connection, event.stream_id)
            sock.sendall(connection.data_to_send())

    def serve() -> None:
        while not stopping.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            with sock:
                sock.settimeout(0.05)
                serve_connection(sock)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stopping.set()
        thread.join(10)
        listener.close()


@pytest.mark.parametrize("how", list(CUT_OFF))
def test_both_clients_raise_unavailable_for_a_stream_cut_off_after_its_first_tokens(how):
    # The tokens may or may not be read before the end that follows them at once is seen.
    with cutting_server(how) as target, Client(target, timeout_s=10) as client:
        tokens = []
        with pytest.raises(UnavailableError):
            for chunk in client.generate("Hello"):
                tokens += chunk.token_ids
        assert tokens in ([], [7, 8])

    async def scenario():
        async with AsyncClient(target, timeout_s=10) as client:
            tokens = []
            with pytest.raises(UnavailableError):
                async for chunk in client.generate("Hello"):
                    tokens += chunk.token_ids
            assert tokens in ([], [7, 8])

    with cutting_server(how) as target:
        asyncio.run(scenario())
