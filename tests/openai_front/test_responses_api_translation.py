"""Responses API bodies -> the gRPC Chat request, without processes: input items as
messages, every field, and every refusal naming its field."""

from __future__ import annotations

import json

import pytest

from pagoda.client.convert import chat_request
from pagoda.openai_front.errors import FrontError
from pagoda.openai_front.responses_api.schema import ResponsesRequest
from pagoda.openai_front.responses_api.translation import plan_response
from pagoda.protos import generation_pb2 as pb
from tests.openai_front.test_tools import WEATHER_SCHEMA

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city.",
    "parameters": WEATHER_SCHEMA,
    "strict": True,
}
TIME = {"type": "function", "name": "get_time"}


def planned(**fields):
    """The one call of a body (input "hi" unless given)."""
    (call,) = plan_response(ResponsesRequest(**{"input": "hi", **fields}), "resp_1").calls
    return call


def grpc_request(**fields) -> pb.ChatRequest:
    call = planned(**fields)
    return chat_request(call.messages, **call.options)


def test_a_string_input_is_one_user_message_at_openais_default_temperature():
    call = planned()
    assert call.messages == [{"role": "user", "content": "hi"}]
    assert call.options == {"temperature": 1.0, "request_id": "resp_1"}
    assert (call.prompt, call.n, call.choice_index) == (None, 1, 0)


def test_every_field_is_passed_on():
    call = planned(
        temperature=0, top_p=0.5, max_output_tokens=16, parallel_tool_calls=False,
        tools=[WEATHER, TIME], tool_choice="required",
        # Accepted, unused or echoed only.
        user="u", safety_identifier="s", metadata={"k": "v"}, store=True, max_tool_calls=3,
        reasoning={"effort": None}, include=["reasoning.encrypted_content"],
        truncation="disabled", top_logprobs=0, service_tier="auto", unknown_field=1,
    )  # fmt: skip
    assert call.options == {
        "temperature": 0,
        "top_p": 0.5,
        "max_new_tokens": 16,
        "request_id": "resp_1",
        "tools": [
            {
                "name": "get_weather",
                "strict": True,
                "description": "The weather of a city.",
                "parameters": json.dumps(WEATHER_SCHEMA),
            },
            {"name": "get_time", "strict": True},  # the Responses API's default
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }


def test_strict_is_true_unless_a_tool_says_false():
    lax = {**WEATHER, "strict": False}
    request = grpc_request(tools=[lax, TIME])
    assert [tool.strict for tool in request.tools] == [False, True]


def test_instructions_come_first_and_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Paris?"}]},
        # A previous response's output, sent back: its text, then its calls.
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
         "arguments": '{"city":"Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_b", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_b",
         "output": [{"type": "input_text", "text": "noon"}]},
        # Calls after a tool's answer are a new assistant turn.
        {"type": "function_call", "call_id": "call_c", "name": "get_time", "arguments": "{}"},
        {"role": "system", "content": "Answer now."},
    ]  # fmt: skip
    call = planned(instructions="You are a weather bot.", input=items)
    assert call.messages == [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_a", "name": "get_weather", "arguments": '{"city":"Paris"}'},
            {"id": "call_b", "name": "get_time", "arguments": "{}"},
        ]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_a"},
        {"role": "tool", "content": "noon", "tool_call_id": "call_b"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_c", "name": "get_time", "arguments": "{}"},
        ]},
        {"role": "system", "content": "Answer now."},
    ]  # fmt: skip
    # The client's converter takes them as they are.
    request = chat_request(call.messages, **call.options)
    assistant = request.messages[3]
    assert [(c.id, c.name) for c in assistant.tool_calls] == [
        ("call_a", "get_weather"),
        ("call_b", "get_time"),
    ]
    assert request.messages[4].tool_call_id == "call_a"


@pytest.mark.parametrize(
    ("text", "constraint"),
    [
        ({"format": {"type": "text"}}, None),
        ({}, None),
        ({"format": {"type": "json_object"}}, {"json_object": True}),
        (
            {
                "format": {
                    "type": "json_schema",
                    "name": "w",
                    "schema": WEATHER_SCHEMA,
                    "strict": True,
                }
            },
            {"json_schema": WEATHER_SCHEMA},
        ),
    ],
)
def test_text_format_is_the_grpc_constraint(text, constraint):
    assert planned(text=text).options.get("constraint") == constraint


def test_a_json_schema_format_reaches_the_grpc_request():
    text = {"format": {"type": "json_schema", "name": "w", "schema": WEATHER_SCHEMA}}
    request = grpc_request(text=text)
    assert json.loads(request.constraint.json_schema) == WEATHER_SCHEMA


@pytest.mark.parametrize(
    ("tool_choice", "field", "value"),
    [
        ("auto", "mode", pb.TOOL_CHOICE_AUTO),
        ("none", "mode", pb.TOOL_CHOICE_NONE),
        ("required", "mode", pb.TOOL_CHOICE_REQUIRED),
        ({"type": "function", "name": "get_weather"}, "function_name", "get_weather"),
    ],
)
def test_tool_choice_becomes_the_grpc_choice(tool_choice, field, value):
    request = grpc_request(tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=True)
    assert request.tool_choice.WhichOneof("choice") == field
    assert getattr(request.tool_choice, field) == value
    assert request.parallel_tool_calls is True
    assert json.loads(request.tools[0].parameters) == WEATHER_SCHEMA


UNSUPPORTED = "unsupported_parameter"
REFUSALS = [
    ({"previous_response_id": "resp_0"}, "previous_response_id", "send the whole conversation",
     UNSUPPORTED),
    ({"conversation": "conv_0"}, "conversation", "send the whole conversation", UNSUPPORTED),
    ({"conversation": {"id": "conv_0"}}, "conversation", "stores no responses", UNSUPPORTED),
    ({"prompt": {"id": "pmpt_0"}}, "prompt", "stores no prompts", UNSUPPORTED),
    ({"background": True}, "background", "not supported", UNSUPPORTED),
    ({"include": ["message.output_text.logprobs"]}, "include", "'message.output_text.logprobs'",
     UNSUPPORTED),
    ({"reasoning": {"effort": "high"}}, "reasoning", "no reasoning settings", UNSUPPORTED),
    ({"reasoning": {"summary": "auto"}}, "reasoning", "no reasoning settings", UNSUPPORTED),
    ({"truncation": "auto"}, "truncation", "never cut short", UNSUPPORTED),
    ({"top_logprobs": 3}, "top_logprobs", "/v1/chat/completions", UNSUPPORTED),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "no verbosity", UNSUPPORTED),
    ({"text": {"format": {"type": "grammar"}}}, "text.format", "'grammar'", UNSUPPORTED),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
     "text.format.schema", None),
    ({"tools": [WEATHER, {"type": "web_search"}]}, "tools[1].type", "'web_search'", UNSUPPORTED),
    ({"tools": [{"type": "function"}]}, "tools[0].name", "must be given", None),
    ({"tool_choice": "get_weather"}, "tool_choice", "'get_weather'", None),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type", "'file_search'", UNSUPPORTED),
    ({"tool_choice": {"type": "function"}}, "tool_choice.name", "name of a function", None),
    ({"input": []}, "input", "at least one item", None),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "'tool'", None),
    ({"input": [{"role": "user"}]}, "input[0].content", "Field required", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content", "'input_image'", UNSUPPORTED),
    ({"input": [{"type": "web_search_call", "action": {}}]}, "input[0].type",
     "'web_search_call'", UNSUPPORTED),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id",
     "Field required", None),
    ({"input": [{"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].output", "'input_file'", UNSUPPORTED),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "words", "code"), REFUSALS)
def test_what_cannot_be_served_is_a_400_naming_its_field(fields, param, words, code):
    with pytest.raises(FrontError) as caught:
        planned(**fields)
    error = caught.value
    assert (error.status, error.param, error.code) == (400, param, code)
    assert param in error.message and words in error.message, error.message
