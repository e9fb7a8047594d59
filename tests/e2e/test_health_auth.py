"""Health over a real server with a bearer token: Check stays open for probes, Watch needs the
token and is bounded; /metrics on a bare :PORT listens on loopback only (review H2, L2)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.conftest import free_port, running_service

pytestmark = pytest.mark.slow

MAX_WATCHERS = 3
TOKEN = (("authorization", "Bearer s3cret-token"),)


def test_watch_needs_the_token_and_is_bounded_while_check_stays_open(tmp_path):
    key_file = tmp_path / "api.key"
    key_file.write_text("s3cret-token\n")
    args = ["--api-key-file", str(key_file), "--max-health-watchers", str(MAX_WATCHERS)]
    with (
        running_service(tmp_path, model="dummy", scheduler_args=args) as service,
        service.channel() as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == serving
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as caught:
                next(health.Watch(health_pb2.HealthCheckRequest(), timeout=10, metadata=metadata))
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        watches = [
            health.Watch(health_pb2.HealthCheckRequest(), timeout=60, metadata=TOKEN)
            for _ in range(MAX_WATCHERS)
        ]
        try:
            for watch in watches:  # the first answer proves each is open on the server
                assert next(watch).status == serving
            with pytest.raises(grpc.RpcError) as caught:
                next(health.Watch(health_pb2.HealthCheckRequest(), timeout=10, metadata=TOKEN))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.RpcError) as caught:
                request = health_pb2.HealthCheckRequest(service="x" * 100_000)
                next(health.Watch(request, timeout=10, metadata=TOKEN))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            for watch in watches:
                watch.cancel()
        # The cancelled ones gave their places back (the server sees the cancels soon).
        done = threading.Event()

        def watch_again() -> None:
            while not done.is_set():
                try:
                    call = health.Watch(health_pb2.HealthCheckRequest(), timeout=10, metadata=TOKEN)
                    next(call)
                    call.cancel()
                    done.set()
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        thread = threading.Thread(target=watch_again)
        thread.start()
        thread.join(timeout=60)
        assert done.is_set()
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == serving


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on `port`, from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                found.add(address)
    return found


def test_metrics_on_a_bare_port_listen_on_loopback_only(tmp_path):
    port = free_port()
    args = ["--metrics-address", f":{port}"]
    with running_service(tmp_path, model="dummy", scheduler_args=args):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
            connection.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert connection.recv(64).startswith(b"HTTP/1.0 200")
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, nothing else
