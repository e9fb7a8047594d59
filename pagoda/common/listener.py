"""The gRPC listener options the scheduler and pagoda-router share, so that a client sees
one kind of server behind either (the router stands in for a scheduler).

Connection liveness: the server pings a connection silent for a minute and closes it if no
answer comes in 20 s (a vanished client's streams end); clients may ping every 30 s, also
between calls, and more often is refused (GOAWAY) as abuse. A connection that has not
finished its TLS and HTTP/2 handshake in SERVER_HANDSHAKE_TIMEOUT_MS is closed (grpc's
default is 120 s): silent connections cost a descriptor each, before authentication
(security review N2).
"""

from __future__ import annotations

# Replies are bounded by validation (a Tokenize reply by the context), not by the request
# cap (max_grpc_message_bytes); a client accepts up to this much.
MIN_SEND_MESSAGE_BYTES = 64 * 1024 * 1024

KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 30_000),
    ("grpc.http2.max_ping_strikes", 2),
]
SERVER_HANDSHAKE_TIMEOUT_MS = 10_000


def listener_options(max_message_bytes: int, max_concurrent_streams: int) -> list[tuple[str, int]]:
    """A listener's options: a request above `max_message_bytes` is refused by grpc before
    any handler or authentication (each call in flight holds one, so the cap bounds what
    strangers can make it hold), replies up to MIN_SEND_MESSAGE_BYTES at least, at most
    `max_concurrent_streams` per connection, no port shared with another process, and the
    liveness above."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max(max_message_bytes, MIN_SEND_MESSAGE_BYTES)),
        ("grpc.max_concurrent_streams", max_concurrent_streams),
        ("grpc.so_reuseport", 0),
        *KEEPALIVE_OPTIONS,
        ("grpc.server_handshake_timeout_ms", SERVER_HANDSHAKE_TIMEOUT_MS),
    ]
