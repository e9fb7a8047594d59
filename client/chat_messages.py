"""Chat messages and tools -> their pagoda.v1 messages (ChatMessage, Tool, ToolChoice):
OpenAI's shapes and the flat ones, each wrong value refused before sending with the path
of the field (`messages[1].tool_calls[0].function.name`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pagoda.client.errors import invalid_argument
from pagoda.client.results import ToolCall
from pagoda.protos import generation_pb2 as pb

# A chat message: a (role, content) pair or a dict of OpenAI's shape, {"role", "content"},
# an assistant's {"role": "assistant", "content": str or None, "tool_calls": [...]} (OpenAI's
# {"id", "type": "function", "function": {"name", "arguments"}} dicts, that inner dict with an
# "id", or ToolCall values from a previous answer, and a thinking model's
# "reasoning_content" from one), a tool's {"role": "tool", "content", "tool_call_id",
# "name" (optional)}.
Message = Mapping[str, Any] | Sequence[str]

_TOOL_CHOICE_MODES = {
    "auto": pb.TOOL_CHOICE_AUTO,
    "none": pb.TOOL_CHOICE_NONE,
    "required": pb.TOOL_CHOICE_REQUIRED,
}


def set_tool_options(request: pb.ChatRequest, options: Mapping[str, Any]) -> None:
    tools = options.get("tools")
    if tools is not None:
        if isinstance(tools, str | Mapping) or not isinstance(tools, Iterable):
            raise invalid_argument("tools must be a list of tools")
        for index, tool in enumerate(tools):
            _set_tool(request.tools.add(), f"tools[{index}]", tool)
    tool_choice = options.get("tool_choice")
    if tool_choice is not None:
        _set_tool_choice(request.tool_choice, tool_choice)
    for name in ("parallel_tool_calls", "stream_tool_calls"):
        value = options.get(name)
        if value is not None:
            if not isinstance(value, bool):
                raise invalid_argument(f"{name} must be True or False, not {value!r:.64}")
            setattr(request, name, value)


def _set_tool(message: pb.Tool, where: str, tool: Any) -> None:
    spec, where = _function_of(tool, where)
    _set_text(message, "name", spec.get("name"), where)
    _set_text(message, "description", spec.get("description"), where)
    _set_json_text(message, "parameters", spec.get("parameters"), where)
    strict = spec.get("strict")
    if strict is not None:
        if not isinstance(strict, bool):
            raise invalid_argument(f"{where}.strict must be True or False, not {strict!r:.64}")
        message.strict = strict


def _set_tool_choice(message: pb.ToolChoice, tool_choice: Any) -> None:
    if isinstance(tool_choice, str) and tool_choice in _TOOL_CHOICE_MODES:
        message.mode = _TOOL_CHOICE_MODES[tool_choice]
    elif isinstance(tool_choice, Mapping):
        spec, where = _function_of(tool_choice, "tool_choice")
        name = spec.get("name")
        if not isinstance(name, str):
            raise invalid_argument(f"{where}.name must be the name of a tool (a string)")
        message.function_name = name
    else:
        raise invalid_argument(
            "tool_choice must be 'auto', 'none', 'required' or one function, "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, not {tool_choice!r:.64}"
        )


def _function_of(value: Any, where: str) -> tuple[Mapping[str, Any], str]:
    """The function dict of OpenAI's {"type": "function", "function": {...}}, or the flat
    dict itself (one without "type" and "function"), with its path for messages."""
    if not isinstance(value, Mapping):
        raise invalid_argument(f"{where} must be a dict, not {type(value).__name__}")
    if "type" not in value and "function" not in value:
        return value, where
    if value.get("type", "function") != "function":
        raise invalid_argument(f"{where}.type must be 'function', not {value.get('type')!r:.64}")
    spec = value.get("function")
    if not isinstance(spec, Mapping):
        raise invalid_argument(f"{where}.function must be a dict")
    return spec, f"{where}.function"


def set_message(message: pb.ChatMessage, index: int, value: Message) -> None:
    if not isinstance(value, Mapping):
        if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2:
            role, content = value
            if isinstance(role, str) and isinstance(content, str):
                message.role, message.content = role, content
                return
        raise invalid_argument(
            f"messages[{index}] must be a {{'role': str, 'content': str}} dict "
            "or a (role, content) pair of strings"
        )
    role, content, tool_calls = value.get("role"), value.get("content"), value.get("tool_calls")
    if content is None and tool_calls:
        content = ""  # an assistant turn of calls only
    if not isinstance(role, str) or not isinstance(content, str):
        raise invalid_argument(
            f"messages[{index}] must be a {{'role': str, 'content': str}} dict "
            "(content may be None beside tool_calls) or a (role, content) pair of strings"
        )
    message.role, message.content = role, content
    where = f"messages[{index}]"
    if tool_calls is not None:
        if isinstance(tool_calls, str | Mapping) or not isinstance(tool_calls, Iterable):
            raise invalid_argument(f"{where}.tool_calls must be a list of calls")
        for number, call in enumerate(tool_calls):
            _set_tool_call(message.tool_calls.add(), f"{where}.tool_calls[{number}]", call)
    _set_text(message, "tool_call_id", value.get("tool_call_id"), where)
    _set_text(message, "name", value.get("name"), where)
    _set_text(message, "reasoning_content", value.get("reasoning_content"), where)


def _set_tool_call(message: pb.ToolCall, where: str, call: Any) -> None:
    if isinstance(call, ToolCall):
        message.id, message.name, message.arguments = call.id, call.name, call.arguments
        return
    if not isinstance(call, Mapping):
        raise invalid_argument(f"{where} must be a dict or a ToolCall, not {type(call).__name__}")
    _set_text(message, "id", call.get("id"), where)
    spec, where_function = _function_of({k: v for k, v in call.items() if k != "id"}, where)
    _set_text(message, "name", spec.get("name"), where_function)
    _set_json_text(message, "arguments", spec.get("arguments"), where_function)


def _set_text(message: Any, name: str, value: Any, where: str) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise invalid_argument(f"{where}.{name} must be a string, not {type(value).__name__}")
    setattr(message, name, value)


def _set_json_text(message: Any, name: str, value: Any, where: str) -> None:
    """A JSON field given as text (sent as it is) or as a value (sent as json.dumps)."""
    if value is None or isinstance(value, str):
        _set_text(message, name, value, where)
        return
    try:
        setattr(message, name, json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise invalid_argument(f"{where}.{name} is not JSON-serializable ({exc})") from None
