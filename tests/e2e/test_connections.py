"""Connections that cost the scheduler before authentication are bounded: a client that
connects and says nothing is disconnected at the handshake timeout (security review N2),
and idle connections to /metrics cost no thread each (N8)."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest

from pagoda.common.listener import SERVER_HANDSHAKE_TIMEOUT_MS
from tests.e2e.conftest import free_port, running_service

pytestmark = pytest.mark.slow

# Far beyond the handshake timeout, far below grpc's default of 120 s.
SILENT_WAIT_S = 3 * SERVER_HANDSHAKE_TIMEOUT_MS / 1000


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closes `sock`; False if it is still open after SILENT_WAIT_S."""
    sock.settimeout(SILENT_WAIT_S)
    try:
        while sock.recv(4096):  # the server's HTTP/2 settings, if it sent any
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_a_silent_connection_is_closed_at_the_handshake_timeout(tmp_path):
    with running_service(tmp_path, model="dummy") as service:
        host, port = service.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as silent:
            assert closed_by_server(silent)
        with socket.create_connection((host, int(port))) as preface_only:
            preface_only.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # and no SETTINGS
            assert closed_by_server(preface_only)


NUM_IDLE_METRICS_CONNECTIONS = 200


def num_threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_idle_metrics_connections_cost_no_thread_each(tmp_path):
    metrics_address = f"127.0.0.1:{free_port()}"
    args = ["--metrics-address", metrics_address]
    with running_service(tmp_path, model="dummy", scheduler_args=args) as service:
        url = f"http://{metrics_address}/metrics"
        assert b"pagoda_requests_running" in urllib.request.urlopen(url, timeout=10).read()
        before = num_threads(service.scheduler.pid)
        host, port = metrics_address.rsplit(":", 1)
        idle = [
            socket.create_connection((host, int(port)), timeout=10)
            for _ in range(NUM_IDLE_METRICS_CONNECTIONS)
        ]
        try:
            # A scrape is answered while they wait, and after them all were accepted.
            assert b"pagoda_requests_running" in urllib.request.urlopen(url, timeout=10).read()
            during = num_threads(service.scheduler.pid)
        finally:
            for connection in idle:
                connection.close()
    assert during - before < 10, f"{before} threads before, {during} with the idle connections"
