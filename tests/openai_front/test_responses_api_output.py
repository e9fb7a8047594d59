"""Chunks -> the Responses API's response object and stream events, without processes,
each checked by the official `openai` package's own types: the Response model, the stream
event union and the state that `client.responses.stream(...)` assembles."""

from __future__ import annotations

import json

import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pagoda.client.results import Chunk, ToolCall, Usage
from pagoda.openai_front.errors import FrontError
from pagoda.openai_front.responses import Choice
from pagoda.openai_front.responses_api.events import ResponseEvents
from pagoda.openai_front.responses_api.output import (
    ResponseHead,
    echoed_settings,
    whole_response,
)
from pagoda.openai_front.responses_api.schema import ResponsesRequest
from pagoda.openai_front.translation import Call

USAGE = Usage(prompt_tokens=9, completion_tokens=4, cached_prompt_tokens=3)
CALL_A = ToolCall("call_" + "a" * 24, "get_weather", '{"city":"Paris"}')
CALL_B = ToolCall("call_" + "b" * 24, "get_time", "{}")
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}
EVENTS = TypeAdapter(ResponseStreamEvent)


def head(**fields) -> ResponseHead:
    body = ResponsesRequest(**{"input": "hi", **fields})
    return ResponseHead("resp_1", 5, "m", echoed_settings(body))


def chunks(*texts: str, reason: str = "stop", calls=()) -> list[Chunk]:
    """One chunk per text, the last one the finish."""
    out = [Chunk("r", text, [7], None, None, None, None) for text in texts]
    out.append(Chunk("r", "", [], None, reason, USAGE, None, tool_calls=tuple(calls)))
    return out


def whole(pieces: list[Chunk], **fields) -> dict:
    choice = Choice(Call(0, 0, None, [], {}))
    for chunk in pieces:
        choice.add(chunk)
    return whole_response(head(**fields), choice)


def parsed_events(text: str) -> list[dict]:
    """The data of each event of an SSE body, its `event:` line checked against its type."""
    events = []
    for block in text.strip().split("\n\n"):
        event_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        events.append(data)
    return events


def streamed(pieces: list[Chunk], **fields) -> list[dict]:
    stream = ResponseEvents(head(**fields))
    texts = stream.opening()
    for chunk in pieces:
        texts += stream.chunk(chunk)
    return parsed_events("".join(texts))


def sdk_final(events: list[dict], tools=()) -> Response:
    """What `client.responses.stream(...).get_final_response()` makes of the events."""
    state = ResponseStreamState(input_tools=list(tools), text_format=omit)
    seen = [out for event in events for out in state.handle_event(EVENTS.validate_python(event))]
    (completed,) = [event for event in seen if event.type == "response.completed"]
    return completed.response


# -- the whole response ---------------------------------------------------------------------


def test_a_text_response_is_one_message_and_the_sdk_reads_its_output_text():
    body = whole(chunks("Hello", " there"))
    response = Response.model_validate(body)  # the SDK's model, validated strictly
    assert response.output_text == "Hello there"
    assert (body["status"], body["incomplete_details"], body["error"]) == ("completed", None, None)
    (message,) = body["output"]
    assert message["id"].startswith("msg_") and len(message["id"]) == len("msg_") + 32
    assert {k: v for k, v in message.items() if k != "id"} == {
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Hello there", "annotations": []}],
    }
    assert body["usage"] == {
        "input_tokens": 9,
        "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 13,
    }
    assert (body["id"], body["object"], body["created_at"], body["model"]) == (
        "resp_1",
        "response",
        5,
        "m",
    )


def test_a_finish_by_length_is_incomplete():
    body = whole(chunks("Hello", reason="length"))
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    assert Response.model_validate(body).output_text == "Hello"


def test_an_empty_output_is_still_a_message():
    (message,) = whole(chunks())["output"]
    assert message["content"][0]["text"] == ""


@pytest.mark.parametrize(("texts", "message"), [((), False), ((" \n",), False), (("Ok.",), True)])
def test_calls_are_function_call_items_after_the_text(texts, message):
    body = whole(chunks(*texts, reason="tool_calls", calls=[CALL_A, CALL_B]), tools=[WEATHER])
    output = body["output"]
    assert [item["type"] for item in output] == ["message"] * message + ["function_call"] * 2
    calls = output[message:]
    assert all(call["id"].startswith("fc_") for call in calls)
    assert [{k: v for k, v in call.items() if k != "id"} for call in calls] == [
        {"type": "function_call", "call_id": CALL_A.id, "name": "get_weather",
         "arguments": '{"city":"Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": CALL_B.id, "name": "get_time",
         "arguments": "{}", "status": "completed"},
    ]  # fmt: skip
    assert body["status"] == "completed"
    Response.model_validate(body)


def test_the_request_settings_are_echoed_with_openais_defaults():
    body = whole(chunks("x"))
    assert {key: body[key] for key in echoed_settings(ResponsesRequest(input="x"))} == {
        "instructions": None,
        "max_output_tokens": None,
        "max_tool_calls": None,
        "metadata": {},
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "tool_choice": "auto",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "background": False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
    }
    fmt = {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}
    given = whole(
        chunks("x"),
        instructions="Be brief.", max_output_tokens=16, metadata={"k": "v"},
        parallel_tool_calls=False, temperature=0, top_p=0.5, tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, text={"format": fmt},
        store=True,
    )  # fmt: skip
    assert given["instructions"] == "Be brief." and given["max_output_tokens"] == 16
    assert given["metadata"] == {"k": "v"} and given["parallel_tool_calls"] is False
    assert (given["temperature"], given["top_p"]) == (0, 0.5)
    assert given["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert given["tools"] == [{**WEATHER, "description": None}]
    assert given["text"] == {"format": fmt} and given["store"] is False
    response = Response.model_validate(given)
    assert response.tools[0].name == "get_weather" and response.text.format.type == "json_schema"


def test_a_call_that_ended_without_its_last_message_is_a_500():
    choice = Choice(Call(0, 0, None, [], {}))
    choice.add(Chunk("r", "x", [7], None, None, None, None))
    with pytest.raises(FrontError) as caught:
        whole_response(head(), choice)
    assert caught.value.status == 500


# -- the stream -----------------------------------------------------------------------------


def test_a_text_stream_in_order_numbered_and_valid():
    events = streamed(chunks("Hel", "", "lo"))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",  # none for the empty chunk
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        EVENTS.validate_python(event)
    created = events[0]["response"]
    assert (created["status"], created["output"], created["usage"]) == ("in_progress", [], None)
    message_id = events[2]["item"]["id"]
    assert events[2]["item"] == {
        "type": "message",
        "id": message_id,
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(d["delta"], d["item_id"], d["output_index"], d["content_index"]) for d in deltas] == [
        ("Hel", message_id, 0, 0),
        ("lo", message_id, 0, 0),
    ]
    assert events[6]["text"] == "Hello"
    final = events[-1]["response"]
    assert final["output"] == [events[8]["item"]] and final["usage"]["total_tokens"] == 13
    assert sdk_final(events).output_text == "Hello"


def test_the_streamed_output_is_the_whole_responses_item_for_item():
    def without_ids(output):
        return [{k: v for k, v in item.items() if k != "id"} for item in output]

    for pieces in (
        chunks("Hi", reason="length"),
        chunks(),
        chunks(" ", "\n", reason="tool_calls", calls=[CALL_A]),
        chunks(" ", "Ok", reason="tool_calls", calls=[CALL_A, CALL_B]),
    ):
        events = streamed(pieces)
        final = events[-1]["response"]
        body = whole(pieces)
        assert events[-1]["type"] == f"response.{body['status']}"
        assert without_ids(final["output"]) == without_ids(body["output"])
        assert (final["status"], final["incomplete_details"]) == (
            body["status"],
            body["incomplete_details"],
        )


def test_whitespace_before_text_is_held_and_sent_with_it():
    events = streamed(chunks("\n", " ", "Hi"))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == ["\n Hi"]


def test_calls_stream_whole_after_the_text():
    events = streamed(chunks("Ok", reason="tool_calls", calls=[CALL_A, CALL_B]), tools=[WEATHER])
    types = [e["type"] for e in events]
    call_events = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert types[-9:] == [*call_events, *call_events, "response.completed"]
    added, delta, done, item_done = events[-9:-5]
    assert added["output_index"] == 1 and added["item"]["arguments"] == ""
    assert added["item"]["status"] == "in_progress" and added["item"]["call_id"] == CALL_A.id
    assert (delta["delta"], done["arguments"]) == (CALL_A.arguments, CALL_A.arguments)
    assert delta["item_id"] == done["item_id"] == added["item"]["id"] == item_done["item"]["id"]
    assert events[-2]["output_index"] == 2
    for event in events:
        EVENTS.validate_python(event)
    final = sdk_final(events, tools=[WEATHER])
    assert final.output_text == "Ok"
    assert [(item.call_id, item.arguments) for item in final.output[1:]] == [
        (CALL_A.id, CALL_A.arguments),
        (CALL_B.id, CALL_B.arguments),
    ]
    assert final.output[1].parsed_arguments == {"city": "Paris"}  # a strict tool's


def test_whitespace_beside_calls_is_no_message():
    events = streamed(chunks(" ", reason="tool_calls", calls=[CALL_B]))
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"] == [
        "function_call"
    ]
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["function_call"]


def test_an_incomplete_stream_ends_with_response_incomplete():
    events = streamed(chunks("Hi", reason="length"))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"
    EVENTS.validate_python(events[-1])


def test_an_error_after_the_stream_began_is_an_error_event():
    stream = ResponseEvents(head())
    opening = stream.opening()
    error = FrontError(503, "the worker is gone", "server_error", None, "service_unavailable")
    (event,) = parsed_events(stream.error(error))
    assert event == {
        "type": "error",
        "sequence_number": len(opening),
        "code": "service_unavailable",
        "message": "the worker is gone",
        "param": None,
    }
    EVENTS.validate_python(event)


def test_a_server_side_cancel_raises_for_the_error_event():
    stream = ResponseEvents(head())
    with pytest.raises(FrontError) as caught:
        stream.chunk(Chunk("r", "", [], None, "cancelled", USAGE, None))
    assert caught.value.status == 503
