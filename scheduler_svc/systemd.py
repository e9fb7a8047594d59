"""sd_notify(3) over $NOTIFY_SOCKET: readiness, status, watchdog keep-alives, stopping.

A no-op when the process does not run under systemd (no NOTIFY_SOCKET).
"""

from __future__ import annotations

import os
import socket


def notify(*assignments: str) -> bool:
    """Send `READY=1`-style lines to systemd; True when a socket took them."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.connect(address)
            sock.sendall("\n".join(assignments).encode())
        except OSError:
            return False
    return True
