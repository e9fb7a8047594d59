"""Calls of tools streamed as the model writes them: chat()'s stream_tool_calls, the pieces
on each chunk (Chunk.tool_call_deltas) and the whole calls on the last one, both ways."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.client import AsyncClient, Client, ToolCallDelta
from pagoda.client.convert import chat_request, chunk_from_response
from pagoda.client.results import ToolCall, join_chunks
from pagoda.protos import generation_pb2 as pb
from tests.client.fake_server import (
    FAKE_CALL_ARGUMENTS,
    FAKE_CALL_ID,
    FAKE_CALL_PIECES,
    FAKE_CALL_TOKENS,
    WEATHER,
)

USER = ("user", "Weather in Paris?")
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_the_option_reaches_the_request_and_is_off_when_left_out():
    assert chat_request([USER], tools=[WEATHER], stream_tool_calls=True).stream_tool_calls
    assert not chat_request([USER], tools=[WEATHER]).stream_tool_calls
    assert not chat_request([USER], stream_tool_calls=False).stream_tool_calls


def test_the_pieces_of_a_response_become_the_chunks_deltas_in_order():
    response = pb.GenerateResponse(
        request_id="r",
        text="",
        tool_call_deltas=[
            pb.ToolCallDelta(index=0, arguments="}"),
            pb.ToolCallDelta(index=1, id="call_b", name="get_time", arguments="{"),
        ],
    )
    chunk = chunk_from_response(response)
    assert chunk.tool_call_deltas == (
        ToolCallDelta(0, "", "", "}"),
        ToolCallDelta(1, "call_b", "get_time", "{"),
    )
    assert chunk_from_response(pb.GenerateResponse(request_id="r")).tool_call_deltas == ()
    with pytest.raises(AttributeError):  # frozen
        chunk.tool_call_deltas[0].arguments = "x"


def joined_pieces(chunks) -> dict[int, ToolCall]:
    """Each call as a client joins its pieces: id and name of the first, the arguments of
    all."""
    calls: dict[int, ToolCall] = {}
    for chunk in chunks:
        for delta in chunk.tool_call_deltas:
            if delta.id:
                assert delta.index == len(calls)  # a call begins after the ones before it
                calls[delta.index] = ToolCall(delta.id, delta.name, delta.arguments)
            else:
                call = calls[delta.index]
                calls[delta.index] = ToolCall(call.id, call.name, call.arguments + delta.arguments)
    return calls


def test_both_clients_stream_the_call_in_pieces_and_end_on_it_whole(fake_server):
    async def scenario() -> list:
        async with AsyncClient(fake_server.target) as client:
            stream = client.chat([USER], tools=[WEATHER], tool_choice=NAMED, stream_tool_calls=True)
            return [chunk async for chunk in stream]

    async_chunks = asyncio.run(asyncio.wait_for(scenario(), timeout=20))
    assert fake_server.servicer.last_request("Chat").stream_tool_calls is True
    with Client(fake_server.target) as client:
        chunks = list(
            client.chat([USER], tools=[WEATHER], tool_choice=NAMED, stream_tool_calls=True)
        )
        whole = list(client.chat([USER], tools=[WEATHER], tool_choice=NAMED))
    assert fake_server.servicer.last_request("Chat").stream_tool_calls is False
    for received in (async_chunks, chunks):
        # One piece per token message, in order; none on the last message.
        assert [[d.arguments for d in c.tool_call_deltas] for c in received] == [
            [piece] for piece in FAKE_CALL_PIECES
        ] + [[]]
        first = received[0].tool_call_deltas[0]
        assert (first.index, first.id, first.name) == (0, FAKE_CALL_ID, "get_weather")
        assert all(not d.id and not d.name for c in received[1:] for d in c.tool_call_deltas)
        completion = join_chunks(received)
        assert completion.finish_reason == "tool_calls"
        assert completion.tool_calls == (
            ToolCall(FAKE_CALL_ID, "get_weather", FAKE_CALL_ARGUMENTS),
        )
        assert list(joined_pieces(received).values()) == list(completion.tool_calls)
        assert len(completion.token_ids) == FAKE_CALL_TOKENS
    assert all(chunk.tool_call_deltas == () for chunk in whole)
    assert join_chunks(whole).tool_calls == join_chunks(chunks).tool_calls


def test_a_call_cut_by_the_length_limit_ends_by_length_with_its_pieces_so_far(fake_server):
    with Client(fake_server.target) as client:
        chunks = list(
            client.chat(
                [USER], tools=[WEATHER], tool_choice=NAMED, stream_tool_calls=True,
                max_new_tokens=2,
            )
        )  # fmt: skip
    completion = join_chunks(chunks)
    (call,) = completion.tool_calls
    assert completion.finish_reason == "length"
    assert call.arguments == "".join(FAKE_CALL_PIECES[:2]) != FAKE_CALL_ARGUMENTS
    assert joined_pieces(chunks) == {0: call}
