"""A Chat's conversation and tools as its model's chat template takes them.

A template that takes `tools` gets them as transformers passes them, and past calls as an
assistant message's "tool_calls" (arguments as a dict). A template that takes none
(GENERIC, the default SmolLM2's) gets the tools described in the system message, with the
Hermes-style tags to call them in, past calls written in the assistant's text, and where
it knows no "tool" role, the tools' answers as user messages in <tool_response> tags.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pagoda.scheduler_svc.tools import (
    ToolFormat,
    ToolsError,
    ValidTools,
    call_arguments,
    check_name,
    check_no_special_text,
)

if TYPE_CHECKING:
    from pagoda.scheduler_svc.tokenizer import TextTokenizer


def generic_tools_prompt(tools: ValidTools) -> str:
    """The system message text that describes the tools to a template without `tools`."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools.for_template())
    return (
        "You may call functions to answer. Each is given as a JSON Schema of its arguments:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call one, answer with its name and arguments as a JSON object between "
        "<tool_call></tool_call> tags, one pair of tags per call:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n'
        "</tool_call>"
    )


def generic_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A past call as a template without tool calls shows it: in the assistant's text."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def template_messages(
    messages: Iterable[Any], tools: ValidTools | None, tokenizer: TextTokenizer
) -> list[dict[str, Any]]:
    """A conversation's pagoda.v1.ChatMessages (roles already checked) as the template takes
    them: transformers' dicts, with an assistant's "tool_calls" ({"id", "type", "function":
    {"name", "arguments": a dict}}) and "reasoning_content", and a tool answer's
    "tool_call_id". For a template
    without tools (GENERIC), the tools' description opens the system message, past calls
    are written in the assistant's text, and where the template knows no "tool" role an
    answer is a user message in <tool_response> tags."""
    generic = tokenizer.tool_format is ToolFormat.GENERIC
    special_texts = tokenizer.special_texts
    conversation: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            if message.role != "assistant":
                raise ToolsError(f"messages[{index}].tool_calls is for an assistant message")
            calls = [
                _past_call(f"messages[{index}].tool_calls[{j}]", call, special_texts)
                for j, call in enumerate(message.tool_calls)
            ]
            if generic:
                shown = [
                    generic_call_text(c["function"]["name"], c["function"]["arguments"])
                    for c in calls
                ]
                entry["content"] = "\n".join(filter(None, [message.content, *shown]))
            else:
                entry["tool_calls"] = calls
        if message.reasoning_content and message.role != "assistant":
            raise ToolsError(f"messages[{index}].reasoning_content is for an assistant message")
        for name in ("tool_call_id", "name", "reasoning_content"):
            value = getattr(message, name)
            if value:
                check_no_special_text(f"messages[{index}].{name}", value, special_texts)
                entry[name] = value
        if message.role == "tool" and "tool" not in tokenizer.known_roles:
            entry = {
                "role": "user",
                "content": f"<tool_response>\n{message.content}\n</tool_response>",
            }
        conversation.append(entry)
    if tools is not None and generic:
        _open_with(conversation, generic_tools_prompt(tools), tokenizer.known_roles)
    return conversation


def _past_call(field_name: str, call: Any, special_texts: tuple[str, ...]) -> dict[str, Any]:
    check_name(f"{field_name}.name", call.name)
    for part in ("id", "arguments"):
        check_no_special_text(f"{field_name}.{part}", getattr(call, part), special_texts)
    arguments = call_arguments(f"{field_name}.arguments", call.arguments)
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


def _open_with(conversation: list[dict[str, Any]], text: str, known_roles: frozenset[str]) -> None:
    """Put `text` first in the system message: the one there, a new one, or (a template
    without the role) the start of the first message."""
    first = conversation[0]
    if first["role"] == "system":
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
    elif "system" in known_roles:
        conversation.insert(0, {"role": "system", "content": text})
    else:
        first["content"] = f"{text}\n\n{first['content']}"
