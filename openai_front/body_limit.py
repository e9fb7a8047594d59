"""An ASGI guard on request bodies, before anything reads them: a POST must say its length
(411 otherwise) and stay within max_body_bytes (413 otherwise). h11 and httptools refuse a
body longer than its Content-Length, so the declared length bounds what is buffered."""

from __future__ import annotations

import json
from typing import Any

from pagoda.openai_front.errors import FrontError

Scope = dict[str, Any]


class BodyLimit:
    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self._app = app
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            headers = dict(scope["headers"])
            length = headers.get(b"content-length")
            if length is None:
                if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
                    error = FrontError(411, "a request body needs a Content-Length header")
                    return await _reply(send, error)
            elif not length.isdigit() or int(length) > self._max_body_bytes:
                error = FrontError(
                    413, f"the request body is above {self._max_body_bytes} bytes", param=None
                )
                return await _reply(send, error)
        await self._app(scope, receive, send)


async def _reply(send: Any, error: FrontError) -> None:
    body = json.dumps(error.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
