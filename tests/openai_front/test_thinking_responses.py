"""The Responses API with a model that thinks: a reasoning item first in the output (whole),
its events before the message's (streamed: OpenAI's order, output indexes and sequence
numbers continuous), each checked by the official `openai` package's types; reasoning items
sent back as input are their assistant turn's reasoning_content; then the whole front in this process against the
client tests' fake gRPC server."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from openai.types.responses import Response

from pagoda.client.results import Chunk
from tests.client.fake_server import FAKE_THOUGHT, FakeGenerationServicer, FakeServer
from tests.openai_front.conftest import with_front
from tests.openai_front.test_responses_api_output import (
    CALL_A,
    EVENTS,
    USAGE,
    WEATHER,
    sdk_final,
    streamed,
    whole,
)
from tests.openai_front.test_responses_api_translation import planned

ANSWER = "(1 messages) you said: hi"


@pytest.fixture(scope="module")
def thinking_server() -> Iterator[FakeServer]:
    with FakeServer(FakeGenerationServicer(thinks=True)) as server:
        yield server


def thinking(*pieces: tuple[str, str], reason: str = "stop", calls=()) -> list[Chunk]:
    """One chunk per (reasoning, text) piece, the last one the finish."""
    out = [Chunk("r", text, [7], None, None, None, None, reasoning_text=r) for r, text in pieces]
    out.append(Chunk("r", "", [], None, reason, USAGE, None, tool_calls=tuple(calls)))
    return out


def without_ids(output: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "id"} for item in output]


# -- without processes ----------------------------------------------------------------------


def test_the_reasoning_item_comes_first_and_the_sdk_reads_the_answer_apart():
    body = whole(thinking(("Hm", ""), (", ok.", "Yes"), ("", ".")))
    reasoning, message = body["output"]
    assert reasoning["id"].startswith("rs_") and len(reasoning["id"]) == len("rs_") + 32
    assert without_ids([reasoning]) == [
        {
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Hm, ok."}],
            "status": "completed",
        }
    ]
    assert message["type"] == "message" and body["usage"]["output_tokens_details"] == {
        "reasoning_tokens": 0
    }
    response = Response.model_validate(body)
    assert response.output_text == "Yes."
    assert response.output[0].content[0].text == "Hm, ok."


@pytest.mark.parametrize(
    ("pieces", "reason", "calls", "items"),
    [
        # Cut short while thinking: the reasoning is as incomplete as the empty answer.
        ([("Hm", ""), (", so", "")], "length", (), [("reasoning", "incomplete"),
                                                  ("message", "incomplete")]),
        # The answer began: the thinking is complete even when the answer is cut.
        ([("Hm", ""), ("", "Ye")], "length", (), [("reasoning", "completed"),
                                                 ("message", "incomplete")]),
        ([("Hm", ""), ("", "\n")], "tool_calls", (CALL_A,), [("reasoning", "completed"),
                                                            ("function_call", "completed")]),
        ([("Hm", "")], "tool_calls", (CALL_A,), [("reasoning", "completed"),
                                                ("function_call", "completed")]),
        ([("", "Hi")], "stop", (), [("message", "completed")]),
    ],
)  # fmt: skip
def test_the_streamed_output_is_the_whole_responses_item_for_item(pieces, reason, calls, items):
    chunks = thinking(*pieces, reason=reason, calls=calls)
    body = whole(chunks, tools=[WEATHER])
    events = streamed(chunks, tools=[WEATHER])
    assert [(item["type"], item["status"]) for item in body["output"]] == items
    assert without_ids(events[-1]["response"]["output"]) == without_ids(body["output"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        EVENTS.validate_python(event)
    if events[-1]["type"] == "response.completed":  # what the SDK's stream state assembles
        final = sdk_final(events, tools=[WEATHER])
        assert [item.type for item in final.output] == [kind for kind, _ in items]


def test_the_reasoning_events_come_first_in_openais_order():
    events = streamed(thinking(("Hm", ""), (", ok.", "Yes"), ("", ".")))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    reasoning_id = events[2]["item"]["id"]
    assert events[2]["item"] == {
        "type": "reasoning",
        "id": reasoning_id,
        "summary": [],
        "content": [],
        "status": "in_progress",
    }
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    on_reasoning = events[3:8]
    assert {(e["item_id"], e["output_index"], e["content_index"]) for e in on_reasoning} == {
        (reasoning_id, 0, 0)
    }
    assert [e["delta"] for e in events[4:6]] == ["Hm", ", ok."]
    assert events[6]["text"] == "Hm, ok."
    assert events[7]["part"] == {"type": "reasoning_text", "text": "Hm, ok."}
    assert events[8]["output_index"] == 0 and events[8]["item"]["status"] == "completed"
    assert {e["output_index"] for e in events[9:16]} == {1}
    final = sdk_final(events)
    assert final.output_text == "Yes."
    assert [item.id for item in final.output] == [reasoning_id, events[9]["item"]["id"]]


def test_reasoning_items_sent_back_as_input_are_their_turns_reasoning_content():
    items = [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
         "content": [{"type": "reasoning_text", "text": "Hm."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Hm."}],
         "encrypted_content": "opaque"},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": "{}"},
        {"role": "user", "content": "and now?"},
    ]  # fmt: skip
    assert planned(input=items).messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Hm.", "tool_calls": [
            {"id": "call_a", "name": "get_weather", "arguments": "{}"},
        ]},
        {"role": "user", "content": "and now?"},
    ]  # fmt: skip
    # A thinking followed by calls only; one with no text of its own is left out.
    items = [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "summary": [], "content": [
            {"type": "reasoning_text", "text": "Call it."}, {"type": "reasoning_text", "text": 7}]},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": "{}"},
        {"type": "reasoning", "summary": [], "content": "not parts"},
    ]  # fmt: skip
    assert planned(input=items).messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [
            {"id": "call_a", "name": "get_weather", "arguments": "{}"},
        ]},
    ]  # fmt: skip


# -- through the front ----------------------------------------------------------------------


def test_the_sdk_reads_the_reasoning_item_whole_and_streamed(thinking_server):
    async def scenario(sdk, _):
        whole_response = await sdk.responses.create(model="fake-model", input="hi")
        events = [event async for event in await sdk.responses.create(input="hi", stream=True)]
        return whole_response, events

    whole_response, events = with_front(thinking_server, scenario)
    for response in (whole_response, events[-1].response):
        assert response.usage.output_tokens_details.reasoning_tokens == 2
        reasoning, message = response.output
        assert (reasoning.type, reasoning.content[0].text) == ("reasoning", FAKE_THOUGHT)
        assert message.type == "message" and response.output_text == ANSWER
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == FAKE_THOUGHT
    done = [e.type for e in events if e.type.endswith(".done")]
    assert done[:3] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]


def test_a_previous_responses_output_sent_back_is_a_conversation_with_its_thinking(
    thinking_server,
):
    async def scenario(sdk, _):
        first = await sdk.responses.create(model="fake-model", input="hi")
        items = [{"role": "user", "content": "hi"}, *first.output]
        return await sdk.responses.create(
            model="fake-model", input=[*items, {"role": "user", "content": "more"}]
        )

    follow_up = with_front(thinking_server, scenario)
    assert follow_up.output_text == "(3 messages) you said: more"
    sent = thinking_server.servicer.last_request("Chat").messages
    assert [(m.role, m.content, m.reasoning_content) for m in sent] == [
        ("user", "hi", ""),
        ("assistant", ANSWER, FAKE_THOUGHT),
        ("user", "more", ""),
    ]


def test_chat_template_kwargs_reach_the_grpc_chat_from_the_responses_api(
    thinking_server, fake_server
):
    async def scenario(sdk, _):
        return await sdk.responses.create(
            model="fake-model",
            input="hi",
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )

    response = with_front(thinking_server, scenario)
    sent = thinking_server.servicer.last_request("Chat")
    assert json.loads(sent.chat_template_kwargs) == {"enable_thinking": False}
    assert [item.type for item in response.output] == ["message"]  # the fake did not think

    async def refused(_, http):
        body = {"input": "hi", "chat_template_kwargs": "enable_thinking=false"}
        return await http.post("/v1/responses", json=body)

    reply = with_front(fake_server, refused)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "chat_template_kwargs"
