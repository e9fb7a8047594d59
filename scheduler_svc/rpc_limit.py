"""--max-concurrent-rpcs, counted while each RPC's handler runs.

grpc's own `maximum_concurrent_rpcs` counts a call until its status is sent. A stream
whose client stopped reading sends its status only when the client reads on or closes
the connection: the status waits behind the data the client does not take, and grpc.aio
cannot reset one stream. So that many stalled streams, opened by anyone over a few
connections, refused every other client until those connections closed
(tests/e2e/test_backpressure.py). This limit counts a handler until it returns, which
--stream-write-timeout-s bounds for a stalled stream; what a stalled call keeps after
that is its own connection's HTTP/2 stream, under --max-concurrent-streams.
"""

from __future__ import annotations

import inspect

import grpc

# The RpcMethodHandler field of each kind of call: (request streaming, response streaming).
_BEHAVIOR_FIELDS = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


class RpcLimit(grpc.aio.ServerInterceptor):
    """At most `limit` RPC handlers run at once; the next is refused RESOURCE_EXHAUSTED."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_active = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: grpc answers UNIMPLEMENTED
            return None
        field = _BEHAVIOR_FIELDS[handler.request_streaming, handler.response_streaming]
        behavior = getattr(handler, field)
        if inspect.isasyncgenfunction(behavior):
            return handler._replace(**{field: self._limit_generator(behavior)})
        if inspect.iscoroutinefunction(behavior):
            return handler._replace(**{field: self._limit_coroutine(behavior)})
        raise TypeError(f"{handler_call_details.method}: a handler that is not async")

    async def _enter(self, context) -> None:
        if self.num_active >= self.limit:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.limit} RPCs are in progress (max_concurrent_rpcs); retry later",
            )
        self.num_active += 1

    def _limit_coroutine(self, behavior):
        async def limited(request, context):
            await self._enter(context)
            try:
                return await behavior(request, context)
            finally:
                self.num_active -= 1

        return limited

    def _limit_generator(self, behavior):
        async def limited(request, context):
            await self._enter(context)
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                self.num_active -= 1

        return limited
