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

import os
import stat
from pathlib import Path

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


class UnsafeSocketDirectory(ValueError):
    """The directory of an ipc:// endpoint could let another user replace the socket."""


def prepare_ipc_directory(endpoint: str) -> None:
    """For an ipc:// endpoint: create its directory private (0700) when missing, and refuse
    one that is a symbolic link, is not this user's, or that others may write: there
    another user could replace the socket and pose as the scheduler or the worker (security
    review N13: /tmp/pagoda-$UID was taken as it was found). Other endpoints: nothing."""
    if not endpoint.startswith("ipc://"):
        return
    directory = Path(endpoint.removeprefix("ipc://")).parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    status = os.lstat(directory)
    if stat.S_ISLNK(status.st_mode) or not stat.S_ISDIR(status.st_mode):
        problem = "is not a directory (a symbolic link?)"
    elif status.st_uid != os.getuid():
        problem = f"belongs to uid {status.st_uid}, not to this user ({os.getuid()})"
    elif status.st_mode & 0o022:
        problem = f"is writable by others (mode {stat.S_IMODE(status.st_mode):04o})"
    else:
        return
    raise UnsafeSocketDirectory(
        f"the socket directory {directory} {problem}; another user could replace the socket. "
        "Remove it, or name a private directory in the zmq endpoint"
    )
