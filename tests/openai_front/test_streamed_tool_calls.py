"""Calls of tools streamed as the model writes them, on chat completions: a streamed request
with tools asks the gRPC Chat for stream_tool_calls, each chunk's pieces become OpenAI's
`tool_calls` deltas (the first of a call with its id, type and name, then more arguments),
and the finish repeats none of them. Checked event by event, and through the whole front
against a scripted gRPC server with the official `openai` package accumulating the deltas."""

from __future__ import annotations

import pytest

from pagoda.client.convert import chat_request
from pagoda.client.results import Chunk, ToolCall, ToolCallDelta, Usage
from pagoda.openai_front.responses import Header
from pagoda.openai_front.schemas import ChatCompletionRequest
from pagoda.openai_front.stream_events import chunk_events
from pagoda.openai_front.translation import Call, plan_chat
from pagoda.protos import generation_pb2 as pb
from tests.client.fake_server import FAKE_CALL_ID, FAKE_CALL_PIECES, WEATHER
from tests.openai_front.conftest import with_front
from tests.openai_front.scripted_chat import (
    CALL_A,
    CALL_B,
    first_piece,
    in_pieces,
    last,
    more,
    scripted_server,
    token,
)
from tests.openai_front.test_tools import MESSAGES, TIME

HEADER = Header("chatcmpl-1", 5, "m", "chat")
USAGE = Usage(prompt_tokens=9, completion_tokens=4, cached_prompt_tokens=0)


@pytest.mark.parametrize(
    ("fields", "streams"),
    [
        ({"stream": True, "tools": [WEATHER]}, True),
        ({"stream": True, "tools": [WEATHER], "tool_choice": "required"}, True),
        ({"tools": [WEATHER]}, False),  # a whole response: calls whole, as before
        ({"stream": True, "tools": [WEATHER], "tool_choice": "none"}, False),
        ({"stream": True}, False),
    ],
)
def test_a_streamed_request_with_tools_asks_for_the_calls_in_pieces(fields, streams):
    body = ChatCompletionRequest(messages=MESSAGES, **fields)
    (call,) = plan_chat(body, "id", 4).calls
    assert chat_request(call.messages, **call.options).stream_tool_calls is streams


def events_of(chunks: list[Chunk]) -> list[tuple[dict, str | None]]:
    """(delta, finish_reason) of each event, the streamed calls counted as app.py does."""
    call = Call(0, 0, None, MESSAGES, {})
    out, num_streamed = [], 0
    for chunk in chunks:
        num_streamed += sum(1 for delta in chunk.tool_call_deltas if delta.id)
        for event in chunk_events(HEADER, call, chunk, None, False, num_streamed):
            (choice,) = event["choices"]
            out.append((choice["delta"], choice["finish_reason"]))
    return out


def chunk(text: str = "", *deltas: ToolCallDelta, **fields) -> Chunk:
    return Chunk("r", text, [7], None, None, None, None, tool_call_deltas=deltas, **fields)


def test_pieces_become_tool_call_deltas_apart_from_the_text_and_the_finish():
    a, b = ToolCall("call_a", "get_weather", '{"city": "Paris"}'), ToolCall("call_b", "f", "{}")
    events = events_of(
        [
            chunk("Let me check.", ToolCallDelta(0, "call_a", "get_weather", "")),
            chunk("", ToolCallDelta(0, "", "", '{"city": '), ToolCallDelta(0, "", "", '"Paris"}')),
            chunk("", ToolCallDelta(0, "", "", ""), ToolCallDelta(1, "call_b", "f", "{}")),
            Chunk("r", "", [], None, "tool_calls", USAGE, None, tool_calls=(a, b)),
        ]
    )
    first_a = {"name": "get_weather", "arguments": ""}
    assert events == [
        ({"content": "Let me check."}, None),
        ({"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": first_a}]},
         None),
        # The pieces of one call in one chunk are one entry; an empty piece is none.
        ({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}, None),
        ({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                          "function": {"name": "f", "arguments": "{}"}}]}, None),
        ({}, "tool_calls"),  # the whole calls are not sent again
    ]  # fmt: skip


def test_a_call_cut_short_ends_by_length_with_its_pieces_so_far():
    cut = ToolCall("call_a", "get_weather", '{"ci')
    events = events_of(
        [
            chunk("", ToolCallDelta(0, "call_a", "get_weather", '{"ci')),
            Chunk("r", "", [7], None, "length", USAGE, None, tool_calls=(cut,)),
        ]
    )
    assert [finish for _, finish in events] == [None, "length"]
    assert events[0][0]["tool_calls"][0]["function"]["arguments"] == '{"ci'


# -- the whole route, in-process against a scripted gRPC server ----------------------------


def accumulated(chunks, choice_index: int = 0) -> dict:
    """One choice of a stream as a client joins it: its content, each call's ids, names
    and arguments as sent (a list each, to see anything sent twice), its finish."""
    out: dict = {"content": "", "calls": {}, "finish": None, "mixed": False}
    for stream_chunk in chunks:
        for choice in stream_chunk.choices:
            if choice.index != choice_index:
                continue
            delta = choice.delta
            out["content"] += delta.content or ""
            out["mixed"] |= bool(delta.content and delta.tool_calls)
            for piece in delta.tool_calls or ():
                call = out["calls"].setdefault(piece.index, {"ids": [], "names": [], "args": ""})
                call["ids"] += [piece.id] if piece.id else []
                call["names"] += [piece.function.name] if piece.function.name else []
                call["args"] += piece.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def streamed_through_front(script, **fields) -> tuple[list, pb.ChatRequest]:
    async def scenario(sdk, _):
        stream = await sdk.chat.completions.create(
            model="fake-model", messages=MESSAGES, tools=[WEATHER, TIME], stream=True, **fields
        )
        return [stream_chunk async for stream_chunk in stream]

    with scripted_server(script) as server:
        chunks = with_front(server, scenario)
        return chunks, server.servicer.last_request("Chat")


def test_text_then_two_calls_stream_in_pieces_each_sent_once():
    a_pieces = in_pieces(CALL_A)
    script = [
        token("Let me "),
        token("check.", a_pieces[0]),
        *[token("", piece) for piece in a_pieces[1:]],
        token("", *in_pieces(CALL_B, index=1)),
        last(CALL_A, CALL_B),
    ]
    chunks, sent = streamed_through_front(script)
    assert sent.stream_tool_calls is True
    choice = accumulated(chunks)
    assert choice["content"] == "Let me check." and choice["finish"] == "tool_calls"
    assert choice["calls"] == {
        0: {"ids": [CALL_A.id], "names": ["get_weather"], "args": CALL_A.arguments},
        1: {"ids": [CALL_B.id], "names": ["get_time"], "args": CALL_B.arguments},
    }
    assert not choice["mixed"]  # content and calls in chunks of their own, as OpenAI's
    # One chunk of calls per gRPC message of pieces: they streamed, not whole at the end.
    num_call_chunks = sum(1 for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    assert num_call_chunks == len(a_pieces) + 1


def test_each_of_n_choices_streams_its_own_calls():
    script = [
        token("Sun", sample=0),
        token("", first_piece(CALL_A), sample=1),
        token("ny.", sample=0),
        token("", more(CALL_A.arguments), sample=1),
        last(reason=pb.STOP, sample=0),
        token("", first_piece(CALL_B, 1, "{}"), sample=1),
        last(CALL_A, CALL_B, sample=1),
    ]
    chunks, _ = streamed_through_front(script, n=2)
    plain, calling = accumulated(chunks, 0), accumulated(chunks, 1)
    assert (plain["content"], plain["calls"], plain["finish"]) == ("Sunny.", {}, "stop")
    assert calling["finish"] == "tool_calls" and calling["content"] == ""
    assert calling["calls"] == {
        0: {"ids": [CALL_A.id], "names": ["get_weather"], "args": CALL_A.arguments},
        1: {"ids": [CALL_B.id], "names": ["get_time"], "args": "{}"},
    }


def test_a_cut_call_streams_its_pieces_and_finishes_by_length():
    cut = pb.ToolCall(id=CALL_A.id, name=CALL_A.name, arguments='{"city": "Pa')
    script = [token("", first_piece(CALL_A, arguments='{"city": ')), token("", more('"Pa'))]
    chunks, _ = streamed_through_front([*script, last(cut, reason=pb.LENGTH)], max_tokens=2)
    choice = accumulated(chunks)
    assert choice["finish"] == "length"
    assert choice["calls"] == {
        0: {"ids": [CALL_A.id], "names": ["get_weather"], "args": cut.arguments}
    }


def test_the_sdk_stream_helper_assembles_the_fake_models_streamed_call(fake_server):
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def scenario(sdk, _):
        fields = dict(model="fake-model", messages=MESSAGES, tools=[WEATHER], tool_choice=named)
        raw = [c async for c in await sdk.chat.completions.create(**fields, stream=True)]
        async with sdk.chat.completions.stream(**fields) as stream:
            return raw, await stream.get_final_completion()

    raw, final = with_front(fake_server, scenario)
    pieces = [c.choices[0].delta.tool_calls for c in raw if c.choices[0].delta.tool_calls]
    assert [p[0].function.arguments for p in pieces] == list(FAKE_CALL_PIECES)
    assert [p[0].id for p in pieces] == [FAKE_CALL_ID] + [None] * (len(FAKE_CALL_PIECES) - 1)
    (call,) = final.choices[0].message.tool_calls
    assert (call.id, call.function.arguments) == (FAKE_CALL_ID, "".join(FAKE_CALL_PIECES))
    assert call.function.parsed_arguments == {"city": "Paris"}  # WEATHER is strict
