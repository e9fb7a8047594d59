"""Connections that cost the scheduler before authentication are bounded (security review
N2): a client that connects and says nothing is disconnected at the handshake timeout."""

from __future__ import annotations

import socket

import pytest
from pagoda.scheduler_svc.api import SERVER_HANDSHAKE_TIMEOUT_MS

from tests.e2e.conftest import running_service

pytestmark = pytest.mark.slow

# Far beyond the handshake timeout, far below grpc's default of 120 s.
SILENT_WAIT_S = 3 * SERVER_HANDSHAKE_TIMEOUT_MS / 1000


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closes `sock`; False if it is still open after SILENT_WAIT_S."""
    sock.settimeout(SILENT_WAIT_S)
    try:
        while sock.recv(4096):  # the server's HTTP/2 settings, if it sent any
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_a_silent_connection_is_closed_at_the_handshake_timeout(tmp_path):
    with running_service(tmp_path, model="dummy") as service:
        host, port = service.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as silent:
            assert closed_by_server(silent)
        with socket.create_connection((host, int(port))) as preface_only:
            preface_only.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # and no SETTINGS
            assert closed_by_server(preface_only)
