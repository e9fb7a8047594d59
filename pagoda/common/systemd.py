"""sd_notify(3) over $NOTIFY_SOCKET: readiness, status, watchdog keep-alives, stopping.

Shared by both processes (the worker imports it too; it needs nothing but the standard
library). A no-op when the process does not run under systemd. Like the configuration
modules, it reads the environment: these variables are systemd's protocol, not settings.
"""

from __future__ import annotations

import os
import socket

DEFAULT_WATCHDOG_INTERVAL_S = 5.0


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


def watchdog_interval_s() -> float:
    """How often to send WATCHDOG=1: half of WatchdogSec ($WATCHDOG_USEC) when set."""
    try:
        return int(os.environ["WATCHDOG_USEC"]) / 2e6
    except (KeyError, ValueError):
        return DEFAULT_WATCHDOG_INTERVAL_S
