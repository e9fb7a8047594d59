"""Tool calling end to end: a real scheduler and worker with a tiny random-weight model, the
real front, the official `openai` client. A random model calls tools only when held to it,
so these ask with tool_choice "required" or a named function: the output is constrained to
calls whose arguments fit the schemas (a short maxLength lets the JSON close well within
max_tokens). The tiny tokenizer spells the tools' description in about 600 tokens, so the
model is a copy with a longer context."""

from __future__ import annotations

import json

import openai
import pytest

from pagoda.client import Client
from pagoda.client.results import join_chunks
from tests.conftest import long_context_copy
from tests.openai_front.conftest import sdk_stack

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Paris is the capital of"}]
MAX_TOKENS = 64


def function(name: str, argument: str) -> dict:
    schema = {
        "type": "object",
        "properties": {argument: {"type": "string", "maxLength": 8}},
        "required": [argument],
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "parameters": schema}}


WEATHER = function("get_weather", "city")
TIME = function("get_time", "zone")
CALL_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def stack(tiny_model_factory, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("tiny-tools")
    model = long_context_copy(tiny_model_factory("llama"), tmp_path / "model")
    with sdk_stack(model, tmp_path) as stack:
        yield stack


# A greedy call of get_weather, asked whole or streamed.
NAMED = dict(
    messages=MESSAGES,
    tools=[WEATHER, TIME],
    tool_choice=CALL_WEATHER,
    max_tokens=MAX_TOKENS,
    temperature=0,
)


def named_call(sdk, model: str):
    return sdk.chat.completions.create(model=model, **NAMED)


def test_a_named_tool_choice_returns_one_call_of_that_tool(stack):
    service, sdk, model = stack
    reply = named_call(sdk, model)
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict) and isinstance(arguments["city"], str)
    assert reply.usage.completion_tokens > 0
    # Straight over gRPC with the Python client: the same call (greedy).
    with Client(service.address, timeout_s=120) as client:
        completion = join_chunks(
            client.chat(
                MESSAGES,
                tools=[WEATHER, TIME],
                tool_choice=CALL_WEATHER,
                max_new_tokens=MAX_TOKENS,
            )
        )
    assert completion.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in completion.tool_calls] == [
        ("get_weather", arguments)
    ]


def test_required_calls_declared_tools_with_object_arguments(stack):
    _, sdk, model = stack
    for seed in range(3):
        reply = sdk.chat.completions.create(
            model=model,
            messages=MESSAGES,
            tools=[WEATHER, TIME],
            tool_choice="required",
            # One call of this tokenizer takes about 50 tokens; room for a few.
            max_tokens=4 * MAX_TOKENS,
            seed=seed,
        )
        (choice,) = reply.choices
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time")
            assert isinstance(json.loads(call.function.arguments), dict)


def test_the_streamed_call_assembles_to_the_whole_one(stack):
    _, sdk, model = stack
    whole = named_call(sdk, model).choices[0].message.tool_calls[0]
    with sdk.chat.completions.stream(model=model, **NAMED) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == (
        whole.function.name,
        whole.function.arguments,
    )
    assert "tool_calls.function.arguments.done" in events


def test_a_bad_tool_is_a_400_naming_the_field(stack):
    _, sdk, model = stack
    bad = {"type": "function", "function": {"name": "lookup", "parameters": [1, 2]}}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=model, messages=MESSAGES, tools=[WEATHER, bad])
    assert "tools[1].parameters" in caught.value.body["message"]
