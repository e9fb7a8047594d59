"""TLS on both sides of the router: to a replica that has a certificate (--tls-root-cert)
and to its own clients (--tls-cert/--tls-key)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.protos import generation_pb2_grpc
from tests.conftest import self_signed_certificate
from tests.e2e.conftest import REPO_ROOT, free_port, running_service, stop_process, wait_until
from tests.e2e.test_dummy_service import dummy_continuation, stream_tokens

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


def test_router_speaks_tls_to_the_replica_and_to_its_clients(tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with running_service(
        tmp_path, model="dummy", scheduler_args=tls, plaintext_health=False
    ) as replica:
        address = f"127.0.0.1:{free_port()}"
        router = subprocess.Popen(
            [sys.executable, "-m", "pagoda.router", "--listen", address,
             "--backends", replica.address, "--tls-root-cert", str(cert), *tls],
            cwd=REPO_ROOT,
        )  # fmt: skip
        try:
            with grpc.secure_channel(address, credentials) as channel:
                health = health_pb2_grpc.HealthStub(channel)

                def serving() -> bool:
                    assert router.poll() is None
                    try:
                        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    except grpc.RpcError:
                        return False
                    return reply.status == health_pb2.HealthCheckResponse.SERVING

                wait_until(serving, 60, "the router to serve over TLS")

            async def one_stream():
                async with grpc.aio.secure_channel(address, credentials) as channel:
                    stub = generation_pb2_grpc.GenerationStub(channel)
                    return await stream_tokens(stub, [5, 6, 7], 4)

            tokens, _ = asyncio.run(one_stream())
            assert tokens == dummy_continuation([5, 6, 7], 4)
        finally:
            assert stop_process(router) == 0
