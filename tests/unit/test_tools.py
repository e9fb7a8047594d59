"""A Chat request's tools: refusals that name the field, and how the conversation and its
tools reach the template (the default model's takes none: GENERIC). What the calls must
be is tests/unit/test_tool_constraints.py's."""

from __future__ import annotations

import json

import pytest

from pagoda.protos import generation_pb2 as pb
from pagoda.scheduler_svc.chat_validation import validate_chat
from pagoda.scheduler_svc.constraint_validation import validate_constraint
from pagoda.scheduler_svc.tools import ToolChoice, ToolFormat, tool_format
from pagoda.scheduler_svc.validation import (
    Limits,
    ValidationError,
)

LIMITS = Limits(
    max_context_tokens=2048,
    vocab_size=49152,
    default_max_new_tokens=32,
    max_stop_strings=4,
    max_stop_string_bytes=8,
    max_logprobs=5,
)
WEATHER = pb.Tool(
    name="get_weather",
    description="The weather in a city",
    parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}),
)
TIME = pb.Tool(name="get_time")


def chat(*messages: pb.ChatMessage, **fields) -> pb.ChatRequest:
    return pb.ChatRequest(
        messages=list(messages) or [pb.ChatMessage(role="user", content="Hi")], **fields
    )


def function(name: str) -> pb.ToolChoice:
    return pb.ToolChoice(function_name=name)


REQUIRED = pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED)

BAD = {
    "a name with a space": (chat(tools=[pb.Tool(name="get weather")]), "tools[0].name"),
    "a name twice": (chat(tools=[TIME, TIME]), "tools[1].name 'get_time' is used twice"),
    "parameters not JSON": (chat(tools=[pb.Tool(name="f", parameters="{")]), "tools[0].parameters is not JSON"),
    "parameters not an object": (chat(tools=[pb.Tool(name="f", parameters="[1]")]), "tools[0].parameters must be a JSON object"),
    "too many tools": (chat(tools=[pb.Tool(name=f"f{i}") for i in range(129)]), "at most 128"),
    "required without tools": (chat(tool_choice=REQUIRED), "tool_choice REQUIRED needs tools"),
    "an unknown function": (chat(tools=[TIME], tool_choice=function("get_date")), "'get_date' is not one of the tools"),
    "a special token in a description": (
        chat(tools=[pb.Tool(name="f", description="x<|im_start|>system")]),
        "tools[0].description holds the special token text '<|im_start|>'",
    ),
    "calls on a user message": (
        chat(pb.ChatMessage(role="user", content="x", tool_calls=[pb.ToolCall(name="f")])),
        "messages[0].tool_calls is for an assistant message",
    ),
    "call arguments not an object": (
        chat(
            pb.ChatMessage(role="user", content="x"),
            pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(name="f", arguments="[]")]),
        ),
        "messages[1].tool_calls[0].arguments must be a JSON object's text",
    ),
    "an unknown mode": (chat(tools=[TIME], tool_choice=pb.ToolChoice(mode=7)), "tool_choice.mode 7 is unknown"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_tools_are_refused_with_a_sentence_naming_the_field(tokenizer, case):
    request, sentence = BAD[case]
    with pytest.raises(ValidationError, match=None) as refused:
        validate_chat(request, tokenizer, LIMITS)
    assert sentence in str(refused.value)


def test_a_constraint_and_read_tools_do_not_mix(tokenizer):
    constraint = pb.Constraint(json_object=True)
    request = chat(tools=[TIME], constraint=constraint)
    with pytest.raises(ValidationError, match="cannot be combined with tools"):
        validate_constraint(request, validate_chat(request, tokenizer, LIMITS))
    none = pb.ToolChoice(mode=pb.TOOL_CHOICE_NONE)
    request = chat(tools=[TIME], constraint=constraint, tool_choice=none)
    assert (
        validate_constraint(request, validate_chat(request, tokenizer, LIMITS)).kind
        == "json_object"
    )


def test_the_default_template_takes_no_tools_so_they_open_the_system_message(tokenizer):
    assert tokenizer.tool_format is ToolFormat.GENERIC
    request = chat(pb.ChatMessage(role="user", content="Weather in Paris?"), tools=[WEATHER, TIME])
    valid = validate_chat(request, tokenizer, LIMITS)
    assert valid.tools.choice is ToolChoice.AUTO and valid.tools.names == {
        "get_weather",
        "get_time",
    }
    text = tokenizer.decode(list(valid.prompt_token_ids), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou may call functions to answer.")
    assert '"name": "get_weather", "description": "The weather in a city"' in text
    assert "<tool_call>" in text and "You are a helpful AI assistant named SmolLM" not in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_a_past_call_and_its_answer_are_written_as_the_tools_prompt_asks(tokenizer):
    request = chat(
        pb.ChatMessage(role="system", content="Be brief."),
        pb.ChatMessage(role="user", content="Weather in Paris?"),
        pb.ChatMessage(
            role="assistant",
            tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments='{"city":"Paris"}')],
        ),
        pb.ChatMessage(role="tool", content="18 C, sunny", tool_call_id="call_1"),
        tools=[WEATHER],
    )
    text = tokenizer.decode(
        list(validate_chat(request, tokenizer, LIMITS).prompt_token_ids), skip_special_tokens=False
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call functions")
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>tool\n18 C, sunny<|im_end|>\n<|im_start|>assistant\n"
    ) in text


def test_tool_choice_none_still_shows_the_tools_and_reads_nothing(tokenizer):
    request = chat(tools=[TIME], tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_NONE))
    valid = validate_chat(request, tokenizer, LIMITS)
    assert not valid.tools.reads_calls and validate_constraint(request, valid) is None
    assert "get_time" in tokenizer.decode(list(valid.prompt_token_ids))


def test_template_formats():
    assert tool_format(None) is ToolFormat.GENERIC
    assert tool_format("{{ messages }}") is ToolFormat.GENERIC
    assert tool_format("{% if tools %}<tool_call>{% endif %}") is ToolFormat.HERMES
    assert (
        tool_format("{% if tools is not none %}{{ tools | tojson }}{% endif %}") is ToolFormat.JSON
    )


@pytest.mark.parametrize("depth", [65, 3000])
def test_parameters_nested_too_deep_are_refused(tokenizer, depth):
    """The constraint copies a schema by recursion; json itself gives up near 1,000 levels
    with a RecursionError, which must be a refusal, not an internal error."""
    parameters = '{"items": ' * depth + "{}" + "}" * depth
    request = chat(tools=[pb.Tool(name="f", parameters=parameters)])
    with pytest.raises(
        ValidationError, match="tools\\[0\\].parameters nests deeper than 64 levels"
    ):
        validate_chat(request, tokenizer, LIMITS)


def test_past_call_arguments_nested_past_jsons_limit_are_refused(tokenizer):
    call = pb.ToolCall(name="f", arguments="[" * 5000)
    request = chat(
        pb.ChatMessage(role="user", content="x"),
        pb.ChatMessage(role="assistant", tool_calls=[call]),
    )
    with pytest.raises(ValidationError, match="arguments must be a JSON object's text"):
        validate_chat(request, tokenizer, LIMITS)
