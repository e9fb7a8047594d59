"""The asyncio client against the fake server (each test runs its own event loop)."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.client import AsyncClient, Completion
from pagoda.client.errors import DeadlineExceededError, UnauthenticatedError
from tests.client.conftest import TEST_API_KEY


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=20))


async def wait_cancelled(server, request_id: str) -> bool:
    return await asyncio.to_thread(server.servicer.wait_cancelled, request_id, 10)


def test_generate_streams_chunks(fake_server):
    async def scenario():
        async with AsyncClient(fake_server.target) as client:
            return [chunk async for chunk in client.generate("a b", max_new_tokens=2)]

    chunks = run(scenario())
    assert [chunk.text for chunk in chunks] == [" t0", " t1", ""]
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 2


def test_complete_chat_tokenize_detokenize_info_stats(fake_server):
    async def scenario():
        async with AsyncClient(fake_server.target) as client:
            completion = await client.complete("echo", top_p=0.5, stop_token_ids=[9])
            chat = [c.text async for c in client.chat([("user", "hi")], max_new_tokens=10)]
            return (
                completion,
                "".join(chat),
                await client.tokenize("ok"),
                await client.detokenize([1, 111, 107], skip_special_tokens=True),
                await client.model_info(),
                await client.server_stats(),
            )

    completion, chat_text, token_ids, text, info, stats = run(scenario())
    assert isinstance(completion, Completion) and completion.finish_reason == "stop"
    assert "top_p: 0.5" in completion.text and "stop_token_ids: 9" in completion.text
    assert chat_text == "(1 messages) you said: hi"
    assert token_ids == [111, 107] and text == "ok"
    assert info.model_id == "fake-model" and stats.worker_connected


def test_breaking_out_cancels_the_rpc(fake_server):
    async def scenario():
        async with AsyncClient(fake_server.target) as client:
            async for chunk in client.generate("hang", request_id="async-break"):
                assert chunk.text == " t0"
                break
            return await wait_cancelled(fake_server, "async-break")

    assert run(scenario())


def test_cancelling_the_awaiting_task_cancels_the_rpc(fake_server):
    async def consume(client, first_chunk: asyncio.Event):
        async for _ in client.chat([("user", "hang")], request_id="async-task"):
            first_chunk.set()

    async def scenario():
        async with AsyncClient(fake_server.target) as client:
            first_chunk = asyncio.Event()
            task = asyncio.create_task(consume(client, first_chunk))
            await first_chunk.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await wait_cancelled(fake_server, "async-task")

    assert run(scenario())


def test_explicit_cancel_ends_the_stream_quietly(fake_server):
    async def scenario():
        async with AsyncClient(fake_server.target) as client:
            stream = client.generate("hang", request_id="async-cancel")
            first = await anext(stream)
            stream.cancel()
            rest = [chunk async for chunk in stream]
            return first.text, rest, await wait_cancelled(fake_server, "async-cancel")

    assert run(scenario()) == (" t0", [], True)


def test_deadline_and_auth(fake_server, auth_server):
    async def scenario():
        async with AsyncClient(fake_server.target, timeout_s=0.3) as client:
            with pytest.raises(DeadlineExceededError):
                await client.complete("hang")
        async with AsyncClient(auth_server.target) as client:
            with pytest.raises(UnauthenticatedError):
                await client.model_info()
        async with AsyncClient(auth_server.target, api_key=TEST_API_KEY) as client:
            return await client.complete("x", max_new_tokens=1)

    assert run(scenario()).text == " t0"


def test_wait_ready(make_server):
    server = make_server()
    server.set_serving(False)

    async def scenario():
        async with AsyncClient(server.target) as client:
            with pytest.raises(DeadlineExceededError, match="NOT_SERVING"):
                await client.wait_ready(timeout_s=0.3)
            asyncio.get_running_loop().call_later(0.2, server.set_serving, True)
            await client.wait_ready(timeout_s=10)

    run(scenario())


def test_client_made_outside_the_loop_opens_its_channel_inside(fake_server):
    client = AsyncClient(fake_server.target)

    async def scenario():
        try:
            return await client.tokenize("a")
        finally:
            await client.close()

    assert run(scenario()) == [97]
