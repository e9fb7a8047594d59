"""The router's gRPC server: the proxied Generation service, its own health (SERVING while
any replica serves) and reflection, over TLS or plaintext."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagoda.common.listener import listener_options
from pagoda.protos import generation_pb2  # noqa: F401  (registers pagoda.v1 for reflection)
from pagoda.router.config import RouterConfig
from pagoda.router.proxy import SERVICE, Router
from pagoda.scheduler_svc.rpc_limit import RpcLimit

HEALTH = health_pb2.HealthCheckResponse


class RouterHealth:
    """The router's grpc.health.v1 answer: SERVING while a replica serves, so that the
    router's own balancer (or systemd, or a client's wait for ready) sees one server."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self._pending: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self._set(False)

    def on_serving(self, serving: bool) -> None:
        """Called from the event loop (sync): the status is set by a task of its own."""
        task = asyncio.create_task(self._set(serving))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _set(self, serving: bool) -> None:
        status = HEALTH.SERVING if serving else HEALTH.NOT_SERVING
        for service in ("", SERVICE):
            await self.servicer.set(service, status)


def build_server(config: RouterConfig, router: Router, health: RouterHealth) -> grpc.aio.Server:
    # The scheduler's (pagoda.common.listener): a client sees one kind of server.
    options = listener_options(config.max_grpc_message_bytes, config.max_concurrent_streams)
    # Counted per running handler, as the scheduler does (scheduler_svc/rpc_limit.py): a
    # stalled stream's place is given back once the write watch ends its handler.
    server = grpc.aio.server(interceptors=[RpcLimit(config.max_concurrent_rpcs)], options=options)
    server.add_generic_rpc_handlers((router.handler(),))
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    if config.tls_cert:
        credentials = grpc.ssl_server_credentials(
            [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())]
        )
        port = server.add_secure_port(config.listen, credentials)
    else:
        port = server.add_insecure_port(config.listen)
    if port == 0:
        raise OSError(f"cannot listen on {config.listen}")
    return server
