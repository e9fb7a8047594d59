"""Fixtures for the client tests: fake servers on ephemeral loopback ports."""

from __future__ import annotations

import pytest

from tests.client.fake_server import FakeGenerationServicer, FakeServer

TEST_API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def fake_server():
    """A shared fake server: no token delay, no auth."""
    with FakeServer(FakeGenerationServicer()) as server:
        yield server


@pytest.fixture(scope="session")
def auth_server():
    """A fake server that requires `authorization: Bearer TEST_API_KEY`."""
    with FakeServer(FakeGenerationServicer(api_key=TEST_API_KEY)) as server:
        yield server


@pytest.fixture
def make_server():
    """Start fake servers with given servicer settings; all are stopped after the test."""
    started: list[FakeServer] = []

    def make(**servicer_kwargs) -> FakeServer:
        server = FakeServer(FakeGenerationServicer(**servicer_kwargs)).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()
