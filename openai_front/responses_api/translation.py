"""A Responses API body -> the one gRPC Chat call that serves it.

Pure: no I/O. `instructions` is a system message put first; a string `input` is one user
message; input items are chat messages ("developer" is "system"), function calls (those
in a row, with an assistant message just before them, are one assistant turn, as the chat
API writes a turn of text and calls) and their outputs (tool messages); a reasoning item
(a previous response's thinking, sent back) is the next assistant turn's
reasoning_content, which a thinking model's template may show again (Qwen3's does after
the last user message). Function tools, tool_choice and parallel_tool_calls
are the Chat's fields, text.format its constraint.
Every value is passed on as given and the scheduler validates it; only what the gRPC API
cannot express, or what needs a stored response, is refused here, naming its field.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

from pydantic import BaseModel, ValidationError

from pagoda.client.convert import GenerationOptions
from pagoda.openai_front.chat_fields import (
    format_constraint,
    function_tool,
    joined_text,
    not_a_function,
    tool_options,
)
from pagoda.openai_front.errors import FrontError, invalid, unsupported_parameter
from pagoda.openai_front.responses_api.schema import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessage,
    ResponsesRequest,
    ResponsesTool,
)
from pagoda.openai_front.translation import OPENAI_DEFAULT_TEMPERATURE, Call, Plan

# The Responses API's roles -> the chat template's.
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
TOOL_CHOICE_MODES = ("auto", "none", "required")
# `include` entries that can be honoured: reasoning items carry their text in the open and
# none is encrypted, so there is no encrypted reasoning to include.
HONOURED_INCLUDES = frozenset({"reasoning.encrypted_content"})
STATELESS = "this server stores no responses: send the whole conversation as input"
Item = TypeVar("Item", bound=BaseModel)


def plan_response(body: ResponsesRequest, response_id: str) -> Plan:
    _refuse_unserved(body)
    text_format = (body.text.format if body.text else None) or {}
    options: dict[str, Any] = {
        "temperature": OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        "top_p": body.top_p,
        "max_new_tokens": body.max_output_tokens,
        "constraint": format_constraint(
            text_format.get("type", "text"),
            text_format.get("schema"),
            "text.format",
            "text.format.schema",
        ),
        "request_id": response_id,
        "chat_template_kwargs": body.chat_template_kwargs,
    }
    options = {name: value for name, value in options.items() if value is not None}
    tools = body.tools
    if tools is not None:
        tools = [_tool(index, tool) for index, tool in enumerate(tools)]
    tool_choice = None if body.tool_choice is None else _tool_choice(body.tool_choice)
    options.update(tool_options(tools, tool_choice, body.parallel_tool_calls, body.stream))
    call = Call(0, 0, None, _messages(body), cast(GenerationOptions, options))
    return Plan([call], num_top_logprobs=None, include_usage=False)


def _refuse_unserved(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise _refused("previous_response_id", STATELESS)
    if body.conversation is not None:
        raise _refused("conversation", STATELESS)
    if body.prompt is not None:
        raise _refused("prompt", "this server stores no prompts: send the text as input")
    if body.background:
        raise _refused("background", "a response is made while its request waits (or streams)")
    unserved = sorted(set(body.include or ()) - HONOURED_INCLUDES)
    if unserved:
        raise _refused("include", f"this server cannot include {unserved[0][:64]!r}")
    if body.reasoning is not None and any(v is not None for v in body.reasoning.values()):
        raise _refused("reasoning", "the served model has no reasoning settings")
    if body.truncation not in (None, "disabled"):
        raise _refused(
            "truncation", "an input too long for the context is refused, never cut short"
        )
    if body.top_logprobs:
        raise _refused("top_logprobs", "logprobs are served by /v1/chat/completions")
    if body.text is not None and body.text.verbosity is not None:
        raise _refused("text.verbosity", "the served model has no verbosity setting")


def _refused(param: str, why: str) -> FrontError:
    return unsupported_parameter(param, f"{param} is not supported: {why}")


def _tool(index: int, tool: ResponsesTool) -> dict[str, Any]:
    if tool.type != "function":
        raise not_a_function(f"tools[{index}].type", tool.type)
    if tool.name is None:
        raise invalid(f"tools[{index}].name must be given", f"tools[{index}].name")
    strict = tool.strict is not False  # the Responses API's default is strict
    return function_tool(tool.name, tool.description, tool.parameters, strict)


def _tool_choice(tool_choice: str | dict[str, Any]) -> str | dict[str, str]:
    """The client's form of tool_choice: a mode, or {"name": ...} for one function."""
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICE_MODES:
            raise invalid(
                "tool_choice must be 'auto', 'none', 'required' or "
                f"{{'type': 'function', 'name': ...}}, not {tool_choice[:64]!r}",
                "tool_choice",
            )
        return tool_choice
    kind = tool_choice.get("type")
    if kind != "function":
        raise not_a_function("tool_choice.type", str(kind))
    name = tool_choice.get("name")
    if not isinstance(name, str):
        raise invalid("tool_choice.name must be the name of a function tool", "tool_choice.name")
    return {"name": name}


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    if not body.input:
        raise invalid("input must hold at least one item", "input")
    for index, item in enumerate(body.input):
        _add_item(messages, index, item)
    return messages


def _add_item(messages: list[dict[str, Any]], index: int, item: dict[str, Any]) -> None:
    where = f"input[{index}]"
    kind = item.get("type", "message")
    if kind == "message":
        message = _parsed(InputMessage, item, where)
        role = ROLES.get(message.role)
        if role is None:
            raise invalid(
                f"{where}.role must be 'user', 'system', 'developer' or 'assistant', "
                f"not {message.role[:64]!r}",
                f"{where}.role",
            )
        content = message.content
        if isinstance(content, list):
            content = joined_text(content, TEXT_PARTS, f"{where}.content")
        if role == "assistant" and _thought_alone(messages):
            messages[-1]["content"] = content  # the answer after its thinking
        else:
            messages.append({"role": role, "content": content})
    elif kind == "function_call":
        call = _parsed(FunctionCallItem, item, where)
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        messages[-1].setdefault("tool_calls", []).append(
            {"id": call.call_id, "name": call.name, "arguments": call.arguments}
        )
    elif kind == "function_call_output":
        result = _parsed(FunctionCallOutputItem, item, where)
        output = result.output
        if isinstance(output, list):
            output = joined_text(output, TEXT_PARTS, f"{where}.output")
        messages.append({"role": "tool", "content": output, "tool_call_id": result.call_id})
    elif kind == "reasoning":
        # A previous response's thinking, in the open: the next assistant turn's
        # reasoning_content (a summary or encrypted content alone is left out).
        parts = item.get("content")
        thought = "".join(
            part["text"]
            for part in (parts if isinstance(parts, list) else [])
            if isinstance(part, dict)
            and part.get("type") == "reasoning_text"
            and isinstance(part.get("text"), str)
        )
        if thought:
            messages.append({"role": "assistant", "content": "", "reasoning_content": thought})
    else:
        raise unsupported_parameter(
            f"{where}.type",
            f"{where}.type {str(kind)[:64]!r} is not supported: the gRPC API takes messages, "
            "function calls and their outputs (and reasoning items' text)",
        )


def _thought_alone(messages: list[dict[str, Any]]) -> bool:
    """Whether the last message is an assistant's thinking with no answer yet."""
    last = messages[-1] if messages else {}
    return bool(last.get("reasoning_content")) and not last["content"] and "tool_calls" not in last


def _parsed(model: type[Item], item: dict[str, Any], where: str) -> Item:
    """`item` as `model`; a bad field is a 400 naming it (`input[2].call_id`)."""
    try:
        return model.model_validate(item)
    except ValidationError as exc:
        problem = exc.errors()[0]
        field = f"{where}.{problem['loc'][0]}" if problem["loc"] else where
        raise invalid(f"{field}: {problem['msg']}", field) from None
