"""/metrics over HTTP on the event loop: one coroutine per connection, never a thread.

prometheus_client's start_http_server runs a thread per connection, so 300 idle
connections took the scheduler from 15 to 315 threads, against the unit's TasksMax=512
(security review N8). Here an idle connection costs a descriptor and a suspended
coroutine until its read timeout, and the collectors run on the loop that owns the state
they read. One request per connection (the response says Connection: close).
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("pagoda.metrics")

# A scraper sends its request at once; a connection that has not in this long is closed.
READ_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 10.0
MAX_REQUEST_HEAD_BYTES = 8192
METRICS_PATHS = frozenset({"/", "/metrics"})


def response(status: str, content_type: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def answer(request_head: bytes, registry: CollectorRegistry) -> bytes:
    """The whole response to one request head (request line and headers)."""
    request_line = request_head.split(b"\r\n", 1)[0].split()
    if len(request_line) != 3 or request_line[0] != b"GET":
        return response("405 Method Not Allowed", "text/plain", b"GET /metrics\n")
    path = request_line[1].split(b"?", 1)[0].decode(errors="replace")
    if path not in METRICS_PATHS:
        return response("404 Not Found", "text/plain", b"GET /metrics\n")
    return response("200 OK", CONTENT_TYPE_LATEST, generate_latest(registry))


async def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            writer.write(answer(head, registry))
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # a silent, slow or vanished client: closed below, nothing to log
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_HEAD_BYTES)
