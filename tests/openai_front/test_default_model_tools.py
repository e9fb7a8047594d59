"""Tool calling through the front with the real default model (SmolLM2-135M-Instruct), whose
template takes no tools (the scheduler describes them and asks for <tool_call> tags): the
README's named-function example, and an `auto` call that the model writes itself after two
examples in the conversation, read by the scheduler and returned whole and streamed."""

from __future__ import annotations

import json

import pytest

from tests.openai_front.conftest import sdk_stack

pytestmark = pytest.mark.slow

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": CITY,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
PARIS = {"role": "user", "content": "What is the weather in Paris?"}


def example(number: int, city: str, answer: str) -> list[dict]:
    """One earlier turn of the conversation: a question, its call, the tool's answer."""
    call_id = f"call_{number:024x}"
    call = {"name": "get_weather", "arguments": json.dumps({"city": city})}
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call_id, "type": "function", "function": call}]},
        {"role": "tool", "tool_call_id": call_id, "content": answer},
        {"role": "assistant", "content": f"It is {answer} in {city}."},
    ]  # fmt: skip


FEW_SHOT = [*example(1, "Rome", "21 C, sunny"), *example(2, "Berlin", "12 C, rain"), PARIS]


@pytest.fixture(scope="module")
def stack(default_model_dir, tmp_path_factory):
    with sdk_stack(default_model_dir, tmp_path_factory.mktemp("default-tools")) as stack:
        yield stack[1:]


def test_the_readme_example_calls_get_weather_for_paris(stack):
    sdk, model = stack
    reply = sdk.chat.completions.create(
        model=model,
        messages=[PARIS],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
    )
    call = reply.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )


def test_auto_reads_the_call_the_model_writes(stack):
    sdk, model = stack
    options = dict(model=model, messages=FEW_SHOT, tools=[WEATHER, TIME], max_tokens=64)
    whole = sdk.chat.completions.create(**options, temperature=0)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    with sdk.chat.completions.stream(**options, temperature=0) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]
    # With tool_choice none the same output is text, not read for calls.
    plain = sdk.chat.completions.create(**options, temperature=0, tool_choice="none")
    assert plain.choices[0].finish_reason == "stop"
    assert "<tool_call>" in plain.choices[0].message.content


def test_the_conversation_goes_on_after_the_tools_answer(stack):
    sdk, model = stack
    first = sdk.chat.completions.create(
        model=model, messages=FEW_SHOT, tools=[WEATHER, TIME], max_tokens=64, temperature=0
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    answer = {"role": "tool", "tool_call_id": call.id, "content": "18 C, cloudy"}
    history = [*FEW_SHOT, message.model_dump(exclude_none=True), answer]
    reply = sdk.chat.completions.create(
        model=model, messages=history, tools=[WEATHER, TIME], max_tokens=32, temperature=0
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "stop" and "18" in choice.message.content
