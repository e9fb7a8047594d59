"""ZeroMQ socket options both ends of the step protocol share.

Besides the protocol's own heartbeats (one a second from an idle worker), ZeroMQ's
transport heartbeats (ZMTP 3.1 PING/PONG) watch the connection itself. libzmq's I/O
thread answers them, so a worker deep in a long forward still does; a hung process or a
host that vanished without closing its connection does not, and its peer closes the
connection after TRANSPORT_TIMEOUT_MS. The scheduler then sees the disconnect at once,
even with a step in flight, instead of waiting for that step's result timeout; a worker
reconnects.
"""

from __future__ import annotations

import zmq

from pagoda.common import wire

TRANSPORT_PING_INTERVAL_MS = 1_000
TRANSPORT_TIMEOUT_MS = 5_000


def configure(socket: zmq.Socket) -> None:
    """No lingering on close, a bound on message size, transport heartbeats."""
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES + 1024)
    socket.setsockopt(zmq.HEARTBEAT_IVL, TRANSPORT_PING_INTERVAL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, TRANSPORT_TIMEOUT_MS)
    # Tells the peer how long to wait for our traffic before it gives up on us.
    socket.setsockopt(zmq.HEARTBEAT_TTL, TRANSPORT_TIMEOUT_MS)
