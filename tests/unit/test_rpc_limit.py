"""scheduler_svc/rpc_limit.py on a real grpc.aio server (loopback): handlers are counted
while they run, whatever their kind, and the one past the limit is refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagoda.scheduler_svc.rpc_limit import RpcLimit

SERVICE = "test.Limited"


def identity(data: bytes) -> bytes:
    return data


async def until(predicate, what: str) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_handlers_are_counted_while_they_run_and_the_next_is_refused():
    async def scenario() -> None:
        release = asyncio.Event()

        async def hold(request, context):  # a stream written with context.write
            await context.write(b"started")
            await release.wait()

        async def generate(request, context):  # a stream as an async generator
            yield b"started"
            await release.wait()

        async def echo(request, context):
            return request

        handlers = {
            "Hold": grpc.unary_stream_rpc_method_handler(hold, identity, identity),
            "Generate": grpc.unary_stream_rpc_method_handler(generate, identity, identity),
            "Echo": grpc.unary_unary_rpc_method_handler(echo, identity, identity),
        }
        limit = RpcLimit(2)
        server = grpc.aio.server(interceptors=[limit])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:

                def call(name: str):
                    kind = channel.unary_unary if name == "Echo" else channel.unary_stream
                    return kind(f"/{SERVICE}/{name}", identity, identity)(b"x")

                held = [call("Hold"), call("Generate")]
                for stream in held:
                    assert await stream.read() == b"started"
                assert limit.num_active == 2
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call("Echo")
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "2 RPCs are in progress" in refused.value.details()
                release.set()
                for stream in held:
                    assert await stream.code() == grpc.StatusCode.OK
                await until(lambda: limit.num_active == 0, "the handlers to be counted out")
                assert await call("Echo") == b"x"
                assert limit.num_active == 0
        finally:
            await server.stop(None)

    asyncio.run(scenario())
