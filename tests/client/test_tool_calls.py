"""Tool calling in the client: chat()'s tools, tool_choice and parallel_tool_calls, the
messages of a conversation with calls, and the calls on the last chunk, both ways."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagoda.client import AsyncClient, Client
from pagoda.client.convert import chat_request, chunk_from_response, generate_request
from pagoda.client.errors import InvalidArgumentError
from pagoda.client.results import ToolCall, join_chunks, join_samples
from pagoda.protos import generation_pb2 as pb
from tests.client.fake_server import (
    FAKE_CALL_ARGUMENTS,
    FAKE_CALL_ID,
    FAKE_CALL_TOKENS,
    TOOL_CHOICES,
    WEATHER,
    WEATHER_SCHEMA,
)

USER = ("user", "Weather in Paris?")


def test_tools_in_openai_and_flat_shapes():
    flat = {"name": "get_time", "description": "Now.", "parameters": '{"type": "object"}'}
    request = chat_request([USER], tools=[WEATHER, flat, {"name": "anything"}])
    assert [(t.name, t.description) for t in request.tools] == [
        ("get_weather", "The weather of a city."),
        ("get_time", "Now."),
        ("anything", ""),
    ]
    # A dict is sent as its JSON text, text as given, none as empty (any object).
    assert json.loads(request.tools[0].parameters) == WEATHER_SCHEMA
    assert [t.parameters for t in request.tools[1:]] == ['{"type": "object"}', ""]
    # `strict` as given (WEATHER's True), False when absent.
    assert [t.strict for t in request.tools] == [True, False, False]


@pytest.mark.parametrize(
    ("tool_choice", "field", "value"),
    [*TOOL_CHOICES, ({"name": "get_weather"}, "function_name", "get_weather")],
)
def test_tool_choice_forms(tool_choice, field, value):
    request = chat_request([USER], tools=[WEATHER], tool_choice=tool_choice)
    assert request.tool_choice.WhichOneof("choice") == field
    assert getattr(request.tool_choice, field) == value


def test_tool_options_left_out_stay_unset():
    request = chat_request([USER])
    assert not request.tools and not request.HasField("tool_choice")
    assert not request.HasField("parallel_tool_calls")
    # False is a real choice, distinct from "unset" (the server's: several calls).
    request = chat_request([USER], tools=[WEATHER], parallel_tool_calls=False)
    assert request.HasField("parallel_tool_calls") and request.parallel_tool_calls is False
    assert chat_request([USER], parallel_tool_calls=True).parallel_tool_calls is True


def test_a_conversation_with_calls_and_their_answers():
    earlier = ToolCall(FAKE_CALL_ID, "get_time", "{}")
    request = chat_request(
        [
            USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    },
                    {"id": "call_b", "name": "get_weather", "arguments": {"city": "Rome"}},
                    earlier,
                ],
            },
            {"role": "tool", "tool_call_id": "call_a", "name": "get_weather", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
            {"role": "assistant", "tool_calls": [earlier]},  # content left out
        ]
    )
    assistant, first, second, calls_only = request.messages[1:]
    assert (assistant.role, assistant.content) == ("assistant", "")
    assert [(c.id, c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == [
        ("call_a", "get_weather", {"city": "Paris"}),
        ("call_b", "get_weather", {"city": "Rome"}),
        (FAKE_CALL_ID, "get_time", {}),
    ]
    assert (first.role, first.tool_call_id, first.name, first.content) == (
        "tool", "call_a", "get_weather", "sunny"
    )  # fmt: skip
    assert (second.tool_call_id, second.name) == ("call_b", "")
    assert calls_only.content == "" and calls_only.tool_calls[0].id == FAKE_CALL_ID


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER, {"type": "function"}]}, "tools[1].function"),
        ({"tools": [{"name": 3}]}, "tools[0].name"),
        ({"tools": [{"name": "f", "description": ["d"]}]}, "tools[0].description"),
        ({"tools": [{"name": "f", "parameters": {"default": object()}}]}, "tools[0].parameters"),
        ({"tools": WEATHER}, "tools"),
        ({"tools": ["get_weather"]}, "tools[0]"),
        ({"tool_choice": "get_weather"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
        ({"tool_choice": 1}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"stream_tool_calls": 1}, "stream_tool_calls"),
        ({"tools": [{"name": "f", "strict": "yes"}]}, "tools[0].strict"),
    ],
)
def test_malformed_tool_options_are_refused_before_sending(options, named):
    with pytest.raises(InvalidArgumentError) as caught:
        chat_request([USER], **options)
    assert named in caught.value.details


@pytest.mark.parametrize(
    ("message", "named"),
    [
        ({"role": "assistant", "content": None}, "messages[1]"),
        ({"role": "assistant", "content": None, "tool_calls": []}, "messages[1]"),
        ({"role": "tool", "content": None, "tool_call_id": "call_a"}, "messages[1]"),
        ({"role": "tool", "content": "x", "tool_call_id": 7}, "messages[1].tool_call_id"),
        ({"role": "tool", "content": "x", "name": None, "tool_call_id": ["a"]}, "tool_call_id"),
        ({"role": "assistant", "tool_calls": {"id": "a"}}, "messages[1].tool_calls"),
        ({"role": "assistant", "tool_calls": ["call_a"]}, "messages[1].tool_calls[0]"),
        (
            {"role": "assistant", "tool_calls": [{"id": "a", "type": "custom", "custom": {}}]},
            "messages[1].tool_calls[0].type",
        ),
        (
            {"role": "assistant", "tool_calls": [{"id": 1, "name": "f", "arguments": "{}"}]},
            "messages[1].tool_calls[0].id",
        ),
        (
            {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": 1}}]},
            "messages[1].tool_calls[0].function.name",
        ),
    ],
)
def test_malformed_call_messages_are_refused_by_path(message, named):
    with pytest.raises(InvalidArgumentError) as caught:
        chat_request([USER, message])
    assert named in caught.value.details


@pytest.mark.parametrize(
    "options",
    [
        {"tools": [WEATHER]},
        {"tool_choice": "required"},
        {"parallel_tool_calls": False},
        {"stream_tool_calls": True},
    ],
)
def test_generate_refuses_the_chat_only_options(options):
    with pytest.raises(InvalidArgumentError) as caught:
        generate_request("x", **options)
    assert f"{next(iter(options))} is an option of chat()" in caught.value.details


def test_the_last_response_carries_the_calls():
    calls = [
        pb.ToolCall(id="call_" + "a" * 24, name="get_weather", arguments='{"city":"Paris"}'),
        pb.ToolCall(id="call_" + "b" * 24, name="get_time", arguments="{}"),
    ]
    streaming = chunk_from_response(pb.GenerateResponse(request_id="r", token_ids=[5, 6]))
    last = chunk_from_response(
        pb.GenerateResponse(
            request_id="r",
            text="Let me check.",
            token_ids=[7],
            finish_reason=pb.TOOL_CALLS,
            tool_calls=calls,
            usage=pb.Usage(prompt_tokens=9, completion_tokens=3),
        )
    )
    assert streaming.tool_calls == () and not streaming.is_last
    assert last.finish_reason == "tool_calls" and last.is_last
    assert last.tool_calls == (
        ToolCall("call_" + "a" * 24, "get_weather", '{"city":"Paris"}'),
        ToolCall("call_" + "b" * 24, "get_time", "{}"),
    )
    completion = join_chunks([streaming, last])
    assert (completion.text, completion.token_ids) == ("Let me check.", [5, 6, 7])
    assert (completion.finish_reason, completion.tool_calls) == ("tool_calls", last.tool_calls)
    assert join_chunks([streaming]).tool_calls == ()
    with pytest.raises(AttributeError):  # frozen
        last.tool_calls[0].name = "other"


def test_each_sample_keeps_its_own_calls():
    def last(index: int, name: str) -> pb.GenerateResponse:
        call = pb.ToolCall(id=f"call_{index}", name=name, arguments="{}")
        return pb.GenerateResponse(
            request_id="r", index=index, finish_reason=pb.TOOL_CALLS, tool_calls=[call]
        )

    responses = [last(1, "g"), pb.GenerateResponse(request_id="r", text="hm"), last(0, "f")]
    samples = join_samples(chunk_from_response(r) for r in responses)
    assert [(s.index, s.text, [c.name for c in s.tool_calls]) for s in samples] == [
        (0, "hm", ["f"]),
        (1, "", ["g"]),
    ]


def test_both_clients_send_the_tools_and_return_the_call(fake_server):
    messages = [USER, {"role": "tool", "tool_call_id": "call_a", "content": "sunny"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}

    async def scenario() -> list:
        async with AsyncClient(fake_server.target) as client:
            stream = client.chat(messages, tools=[WEATHER], tool_choice=choice)
            return [chunk async for chunk in stream]

    async_chunks = asyncio.run(asyncio.wait_for(scenario(), timeout=20))
    sent = fake_server.servicer.last_request("Chat")
    assert [t.name for t in sent.tools] == ["get_weather"]
    assert sent.tool_choice.function_name == "get_weather"
    assert sent.messages[1].tool_call_id == "call_a"
    with Client(fake_server.target) as client:
        chunks = list(client.chat(messages, tools=[WEATHER], tool_choice=choice))
        plain = join_chunks(client.chat([USER], tools=[WEATHER], parallel_tool_calls=False))
    assert fake_server.servicer.last_request("Chat").parallel_tool_calls is False
    for received in (async_chunks, chunks):
        completion = join_chunks(received)
        assert completion.finish_reason == "tool_calls" and completion.text == ""
        assert completion.tool_calls == (
            ToolCall(FAKE_CALL_ID, "get_weather", FAKE_CALL_ARGUMENTS),
        )
        assert len(completion.token_ids) == FAKE_CALL_TOKENS
        assert all(chunk.tool_calls == () for chunk in received[:-1])
    assert plain.finish_reason == "length" and plain.tool_calls == ()
