"""Calls of tools streamed as the model writes them, on the Responses API: each call is a
function_call item that streams (output_item.added, a function_call_arguments.delta per
piece, function_call_arguments.done, output_item.done), in the order the model wrote the
items, and the final response is the whole one's, item for item. Checked on chunks, with
the official `openai` package's event types and stream state, and through the whole front
against a scripted gRPC server."""

from __future__ import annotations

import json

import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from pagoda.client.convert import chat_request
from pagoda.client.results import Chunk, ToolCall, ToolCallDelta, Usage
from pagoda.openai_front.responses import Choice
from pagoda.openai_front.responses_api.events import ResponseEvents
from pagoda.openai_front.responses_api.output import ResponseHead, echoed_settings, whole_response
from pagoda.openai_front.responses_api.schema import ResponsesRequest
from pagoda.openai_front.responses_api.translation import plan_response
from pagoda.openai_front.translation import Call
from tests.openai_front.conftest import with_front
from tests.openai_front.scripted_chat import CALL_A, CALL_B, in_pieces, last, scripted_server, token

EVENTS = TypeAdapter(ResponseStreamEvent)
USAGE = Usage(prompt_tokens=9, completion_tokens=4, cached_prompt_tokens=0)
A = ToolCall(CALL_A.id, CALL_A.name, CALL_A.arguments)
B = ToolCall(CALL_B.id, CALL_B.name, CALL_B.arguments)
CUT = ToolCall(A.id, A.name, '{"ci')
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
]
MESSAGE_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.mark.parametrize(
    ("fields", "streams"),
    [
        ({"stream": True, "tools": [WEATHER]}, True),
        ({"tools": [WEATHER]}, False),
        ({"stream": True, "tools": [WEATHER], "tool_choice": "none"}, False),
        ({"stream": True}, False),
    ],
)
def test_a_streamed_response_with_tools_asks_for_the_calls_in_pieces(fields, streams):
    (call,) = plan_response(ResponsesRequest(input="hi", **fields), "resp_1").calls
    assert chat_request(call.messages, **call.options).stream_tool_calls is streams


def piece(index: int, arguments: str, call: ToolCall | None = None) -> ToolCallDelta:
    """A call's first piece when `call` is given, else more of its arguments."""
    return ToolCallDelta(index, call.id if call else "", call.name if call else "", arguments)


def chunk(text: str = "", *deltas: ToolCallDelta, reasoning: str = "") -> Chunk:
    return Chunk(
        "r", text, [7], None, None, None, None, reasoning_text=reasoning, tool_call_deltas=deltas
    )


def finish(*calls: ToolCall, reason: str = "tool_calls") -> Chunk:
    return Chunk("r", "", [], None, reason, USAGE, None, tool_calls=calls)


SCENARIOS = {
    "text, then two calls": [
        chunk("Let me check.", piece(0, "", A)),
        chunk("", piece(0, '{"city": '), piece(0, '"Paris"}')),
        chunk("", piece(1, "{}", B)),
        finish(A, B),
    ],
    "a call, then text": [chunk("", piece(0, A.arguments, A)), chunk(" Done."), finish(A)],
    "whitespace, then a call": [chunk("\n"), chunk(" ", piece(0, A.arguments, A)), finish(A)],
    "thinking, then a call": [
        chunk(reasoning="Hm."),
        chunk("", piece(0, "", A)),
        chunk("", piece(0, A.arguments)),
        finish(A),
    ],
    "text, then a cut call": [
        chunk("Ok", piece(0, "", A)),
        chunk("", piece(0, CUT.arguments)),
        finish(CUT, reason="length"),
    ],
    "a call, then text cut": [
        chunk("", piece(0, A.arguments, A)),
        chunk("\nAnd"),
        finish(A, reason="length"),
    ],
    "calls whole at the finish": [chunk("Ok"), finish(A, B)],
}
# (type, status) of each output item: the order the model wrote them in.
OUTPUTS = {
    "text, then two calls": [
        ("message", "completed"),
        ("function_call", "completed"),
        ("function_call", "completed"),
    ],
    "a call, then text": [("function_call", "completed"), ("message", "completed")],
    "whitespace, then a call": [("function_call", "completed")],
    "thinking, then a call": [("reasoning", "completed"), ("function_call", "completed")],
    "text, then a cut call": [("message", "completed"), ("function_call", "incomplete")],
    "a call, then text cut": [("function_call", "completed"), ("message", "incomplete")],
    "calls whole at the finish": [
        ("message", "completed"),
        ("function_call", "completed"),
        ("function_call", "completed"),
    ],
}


def head() -> ResponseHead:
    return ResponseHead("resp_1", 5, "m", echoed_settings(ResponsesRequest(input="hi")))


def streamed(chunks: list[Chunk]) -> list[dict]:
    stream = ResponseEvents(head())
    texts = stream.opening()
    for each in chunks:
        texts += stream.chunk(each)
    return [
        json.loads(line.removeprefix("data: "))
        for text in texts
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


def whole(chunks: list[Chunk]) -> dict:
    choice = Choice(Call(0, 0, None, [], {}))
    for each in chunks:
        choice.add(each)
    return whole_response(head(), choice)


def without_ids(output: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "id"} for item in output]


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_streamed_items_are_the_whole_responses_in_the_order_written(name):
    events = streamed(SCENARIOS[name])
    final, body = events[-1]["response"], whole(SCENARIOS[name])
    assert [(item["type"], item["status"]) for item in final["output"]] == OUTPUTS[name]
    assert without_ids(final["output"]) == without_ids(body["output"])
    assert (events[-1]["type"], final["status"]) == (f"response.{body['status']}", body["status"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        EVENTS.validate_python(event)
    # Each item is added at its place in the output and done before the next is added.
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == list(range(len(final["output"])))
    assert [e["item"] for e in done] == final["output"]
    opened = [e["type"] for e in events if e["type"].startswith("response.output_item.")]
    assert opened == ["response.output_item.added", "response.output_item.done"] * len(added)
    # The package's own stream state assembles the same response.
    state = ResponseStreamState(input_tools=[WEATHER], text_format=omit)
    seen = [out for e in events for out in state.handle_event(EVENTS.validate_python(e))]
    assert [item.type for item in seen[-1].response.output] == [t for t, _ in OUTPUTS[name]]


def test_a_call_streams_its_pieces_between_added_and_done():
    events = streamed(SCENARIOS["text, then two calls"])
    first_call = next(
        i for i, e in enumerate(events) if e.get("item", {}).get("type") == "function_call"
    )
    a_events = events[first_call : first_call + 5]
    assert [e["type"] for e in a_events] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    added, *deltas, arguments_done, item_done = a_events
    assert {k: v for k, v in added["item"].items() if k != "id"} == {
        "type": "function_call",
        "call_id": A.id,
        "name": "get_weather",
        "arguments": "",
        "status": "in_progress",
    }
    item_id = added["item"]["id"]
    assert item_id.startswith("fc_") and added["output_index"] == 1
    assert [(d["delta"], d["item_id"], d["output_index"]) for d in deltas] == [
        ('{"city": ', item_id, 1),
        ('"Paris"}', item_id, 1),
    ]
    assert (arguments_done["arguments"], arguments_done["item_id"]) == (A.arguments, item_id)
    assert item_done["item"] == {**added["item"], "arguments": A.arguments, "status": "completed"}
    # The message before the call ended when the call began; the next call follows.
    assert [e["type"] for e in events[first_call - 3 : first_call]] == MESSAGE_EVENTS[3:]
    assert [e["type"] for e in events[first_call + 5 :]] == [*CALL_EVENTS, "response.completed"]


# -- the whole route, in-process against a scripted gRPC server ----------------------------


def test_through_the_front_the_stream_ends_on_the_whole_responses_output():
    a_pieces = in_pieces(CALL_A)
    script = [
        token("Checking."),
        *[token("", p) for p in a_pieces],
        token("", *in_pieces(CALL_B, index=1)),
        last(CALL_A, CALL_B),
    ]

    async def scenario(sdk, _):
        fields = dict(model="fake-model", input="Weather?", tools=[WEATHER])
        events = [e async for e in await sdk.responses.create(**fields, stream=True)]
        asked = server.servicer.last_request("Chat").stream_tool_calls
        return events, asked, await sdk.responses.create(**fields)

    with scripted_server(script) as server:
        events, asked, whole_body = with_front(server, scenario)
        assert asked is True
        assert server.servicer.last_request("Chat").stream_tool_calls is False
    final = events[-1].response.model_dump()
    assert events[-1].type == "response.completed"
    assert without_ids(final["output"]) == without_ids(whole_body.model_dump()["output"])
    assert [(i.type, getattr(i, "call_id", None)) for i in events[-1].response.output] == [
        ("message", None),
        ("function_call", CALL_A.id),
        ("function_call", CALL_B.id),
    ]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) == len(a_pieces)  # A's pieces of arguments (its first has none), B's one
    assert "".join(d.delta for d in deltas if d.output_index == 1) == CALL_A.arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))
