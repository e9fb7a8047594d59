"""The Responses API end to end: a real scheduler and worker with a tiny random-weight model,
the real front, the official `openai` client's `client.responses`. A random model calls
tools only when held to it, so the call is asked for by name (its arguments then fit the
schema). The tools' description in the system message needs more than the tiny model's
256 positions, so the model is a copy with a longer context."""

from __future__ import annotations

import json

import openai
import pytest

from tests.conftest import long_context_copy
from tests.openai_front.conftest import sdk_stack

pytestmark = pytest.mark.slow

QUESTION = "Paris is the capital of"
MAX_OUTPUT_TOKENS = 16
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def stack(tiny_model_factory, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("tiny-responses")
    model = long_context_copy(tiny_model_factory("llama"), tmp_path / "model")
    with sdk_stack(model, tmp_path) as (_, sdk, model_id):
        yield sdk, model_id


def test_a_string_input_gives_output_text_and_usage(stack):
    sdk, model = stack
    response = sdk.responses.create(
        model=model, input=QUESTION, max_output_tokens=MAX_OUTPUT_TOKENS, temperature=0
    )
    assert response.status in ("completed", "incomplete")
    assert isinstance(response.output_text, str)
    (message,) = response.output
    assert message.type == "message" and message.id.startswith("msg_")
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= MAX_OUTPUT_TOKENS
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if response.status == "incomplete":
        assert usage.output_tokens == MAX_OUTPUT_TOKENS
        assert response.incomplete_details.reason == "max_output_tokens"


def test_the_streamed_text_is_the_whole_text_at_temperature_zero(stack):
    sdk, model = stack
    fields = dict(model=model, input=QUESTION, max_output_tokens=MAX_OUTPUT_TOKENS, temperature=0)
    whole = sdk.responses.create(**fields)
    with sdk.responses.stream(**fields) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response() if whole.status == "completed" else None
    assert "".join(deltas) == whole.output_text
    if final is not None:
        assert final.output_text == whole.output_text
        assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_named_function_gives_one_call_whose_arguments_parse(stack):
    sdk, model = stack
    question = {"role": "user", "content": "Weather in Paris?"}
    response = sdk.responses.create(
        model=model,
        input=[question],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        temperature=0,
    )
    assert response.status == "completed"
    (call,) = response.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    arguments = json.loads(call.arguments)
    assert isinstance(arguments, dict) and isinstance(arguments["city"], str)
    # The call and its output, sent back, make the next turn (the scheduler takes them).
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    follow_up = sdk.responses.create(
        model=model,
        input=[question, call.model_dump(exclude_none=True), answer],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=8,
    )
    assert follow_up.output[0].type == "message" and follow_up.usage.output_tokens > 0


def test_a_json_schema_format_gives_json_that_fits(stack):
    sdk, model = stack
    response = sdk.responses.create(
        model=model,
        input="Is the sea blue? Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "x", "schema": ANSWER_SCHEMA}},
        max_output_tokens=64,
    )
    assert response.status == "completed"
    assert json.loads(response.output_text) in ({"answer": "yes"}, {"answer": "no"})
    assert response.text.format.type == "json_schema"


def test_previous_response_id_is_a_400(stack):
    sdk, model = stack
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(model=model, input="Go on", previous_response_id="resp_123")
    assert caught.value.body["param"] == "previous_response_id"
    assert "send the whole conversation" in caught.value.body["message"]
