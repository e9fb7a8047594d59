"""How the client reaches a server: target, TLS, bearer key, deadline and channel options."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from pagoda.common.listener import MIN_SEND_MESSAGE_BYTES
from pagoda.common.settings import DEFAULT_GRPC_ADDRESS

DEFAULT_TARGET = DEFAULT_GRPC_ADDRESS  # where the scheduler listens by default

# Reconnect quickly: a local server that restarts (or starts after its client) is found
# again within a second instead of after gRPC's default backoff of up to two minutes.
# Also the router's, towards its replicas (router/backends.py).
RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
CHANNEL_OPTIONS: tuple[tuple[str, str | int], ...] = (
    ("grpc.primary_user_agent", "pagoda-client"),
    *RECONNECT_OPTIONS,
    # Replies as large as a scheduler or router may send.
    ("grpc.max_receive_message_length", MIN_SEND_MESSAGE_BYTES),
)

# Between two health checks while waiting for a server to become ready.
READY_POLL_INTERVAL_S = 0.05
# Longest single health check while waiting; later checks use what is left.
READY_CHECK_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    """Immutable per-client settings; `timeout_s` is the deadline of every call (None: none)."""

    target: str = DEFAULT_TARGET
    api_key: str | None = None
    # PEM root certificates; when set the channel uses TLS.
    tls_root_cert: bytes | None = None
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.api_key is not None and (not self.api_key or "\n" in self.api_key):
            raise ValueError("api_key must be a non-empty single line")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        if self.api_key is None:
            return ()
        return (("authorization", f"Bearer {self.api_key}"),)

    @property
    def credentials(self) -> grpc.ChannelCredentials | None:
        if self.tls_root_cert is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.tls_root_cert)

    def open_channel(self) -> grpc.aio.Channel:
        """A grpc.aio channel to `target` (TLS when `tls_root_cert` is set); call it inside the
        event loop that will own the channel."""
        credentials = self.credentials
        if credentials is None:
            return grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(self.target, credentials, options=CHANNEL_OPTIONS)
