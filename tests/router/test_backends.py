"""What the router believes of a replica's cache when its health changes: a NOT_SERVING
answer or a refused connection drops it, a check that only timed out (a busy replica)
keeps it. In process: a grpc.aio health server whose answers the test sets."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.router.prefix_index import chunk_hashes
from pagoda.router.proxy import Router, RouterSettings
from pagoda.router.routing_key import RoutingKey
from tests.e2e.conftest import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.status = SERVING
        self.delay_s = 0.0

    async def Check(self, request, context):
        await asyncio.sleep(self.delay_s)
        return health_pb2.HealthCheckResponse(status=self.status)


async def until(predicate, timeout_s: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_slow_check_keeps_the_picture_a_not_serving_answer_drops_it():
    async def scenario():
        health = Health()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        address = f"127.0.0.1:{free_port()}"
        server.add_insecure_port(address)
        await server.start()
        router = Router([address], None, RouterSettings(health_interval_s=0.05), lambda _: None)
        router.start()
        try:
            (backend,) = router.backends
            await until(lambda: backend.serving)
            router.route(RoutingKey(chunk_hashes("x" * 640, 64, seed=""), 1, ""), tried=[])

            health.delay_s = 1.5  # past the 1 s check timeout: a busy replica
            await until(lambda: not backend.serving)
            assert router.num_cached_chunks(address) == 10
            health.delay_s = 0.0
            await until(lambda: backend.serving)

            health.status = NOT_SERVING  # its worker is gone, and its cache with it
            await until(lambda: not backend.serving)
            assert router.num_cached_chunks(address) == 0
        finally:
            await router.close()
            await server.stop(None)

    asyncio.run(scenario())
