"""One mapping from grpc.StatusCode to PagodaError subclasses, used by both clients."""

from __future__ import annotations

import asyncio

import grpc
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
