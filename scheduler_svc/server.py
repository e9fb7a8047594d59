"""The gRPC server of the scheduler: Generation (with parsers that refuse bad bytes as
INVALID_ARGUMENT), health, reflection, bearer auth, the RPC limit, TLS and the connection
options.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagoda.common.listener import listener_options
from pagoda.protos import generation_pb2
from pagoda.scheduler_svc.api import SERVICE_NAME, GenerationServicer
from pagoda.scheduler_svc.auth import BearerAuth, read_api_keys, warn_if_exposed
from pagoda.scheduler_svc.core import ConfigError
from pagoda.scheduler_svc.refusals import Undecodable
from pagoda.scheduler_svc.rpc_limit import RpcLimit
from pagoda.scheduler_svc.settings import ServiceConfig

# Longest service name a health Watch may name: each watched name is a key the health
# servicer keeps while watched; real ones are "" and "pagoda.v1.Generation".
MAX_HEALTH_SERVICE_NAME_CHARS = 128


class BoundedHealthServicer(health.aio.HealthServicer):
    """grpc's health servicer with a bound on concurrent Watch streams (and their names)."""

    def __init__(self, max_watchers: int) -> None:
        super().__init__()
        self._max_watchers = max_watchers
        self._num_watchers = 0

    async def Watch(self, request, context) -> None:
        # Refusals set the status and return: no abort (see Refused).
        if len(request.service) > MAX_HEALTH_SERVICE_NAME_CHARS:
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(
                f"service name longer than {MAX_HEALTH_SERVICE_NAME_CHARS} characters"
            )
            return
        if self._num_watchers >= self._max_watchers:
            context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.set_details(
                f"{self._max_watchers} health watchers are open; use Check, or retry later"
            )
            return
        self._num_watchers += 1
        try:
            await super().Watch(request, context)
        finally:
            self._num_watchers -= 1


def _tolerant_parser(message_class):
    """A deserializer that never raises: grpc.aio would answer UNKNOWN and log a traceback."""

    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError:
            return Undecodable(message_class.DESCRIPTOR.full_name)

    return parse


def _generation_handler(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    """The Generation service, registered with parsers that turn bad bytes into INVALID_ARGUMENT."""
    pb = generation_pb2
    streams = {"Generate": pb.GenerateRequest, "Chat": pb.ChatRequest}
    unaries = {
        "Tokenize": pb.TokenizeRequest,
        "Detokenize": pb.DetokenizeRequest,
        "GetModelInfo": pb.ModelInfoRequest,
        "GetServerStats": pb.ServerStatsRequest,
    }
    handlers = {
        name: grpc.unary_stream_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=_tolerant_parser(request_class),
            response_serializer=pb.GenerateResponse.SerializeToString,
        )
        for name, request_class in streams.items()
    }
    handlers.update(
        {
            name: grpc.unary_unary_rpc_method_handler(
                getattr(servicer, name),
                request_deserializer=_tolerant_parser(request_class),
                response_serializer=lambda message: message.SerializeToString(),
            )
            for name, request_class in unaries.items()
        }
    )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def build_server(
    config: ServiceConfig, servicer: GenerationServicer
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The grpc.aio server with Generation, health (NOT_SERVING until a worker) and reflection."""
    interceptors = []
    if config.api_key_file:
        interceptors.append(BearerAuth(read_api_keys(config.api_key_file)))
    # Beyond max_concurrent_rpcs (all connections together) running handlers, the next RPC
    # gets RESOURCE_EXHAUSTED: counted by handler, not by grpc's maximum_concurrent_rpcs,
    # whose count a stalled stream keeps for as long as its connection lives (rpc_limit).
    interceptors.append(RpcLimit(config.max_concurrent_rpcs))
    options = [
        *listener_options(config.max_grpc_message_bytes, config.max_concurrent_streams),
        ("grpc.max_connection_idle_ms", int(config.max_connection_idle_s * 1000)),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    server.add_generic_rpc_handlers((_generation_handler(servicer),))
    health_servicer = BoundedHealthServicer(config.max_health_watchers)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    if config.tls_cert:
        warn_if_exposed(config.tls_key, "the TLS key")
        try:
            credentials = grpc.ssl_server_credentials(
                [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())]
            )
        except OSError as exc:
            raise ConfigError(f"cannot read the TLS files: {exc}") from None
        port = server.add_secure_port(config.grpc_address, credentials)
    else:
        port = server.add_insecure_port(config.grpc_address)
    if port == 0:
        raise ConfigError(f"cannot listen on {config.grpc_address}")
    return server, health_servicer
