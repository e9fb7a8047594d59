"""Tools (function calling) of a Chat request: checked, shown to the model, and what its
output must be.

The model sees a request's tools through its chat template (tool_templates.py: the
template's own `tools`, or for one that takes none, a system message asking for
Hermes-style <tool_call> tags). What the output is depends on tool_choice:
- AUTO: whatever the model writes, read for calls in its template's format
  (scheduler_svc.tool_calls), text streamed until a call may begin; with a strict tool,
  each call the model makes is constrained (in the tagged formats a lazy grammar: free
  text until "<tool_call>", then a call's JSON until "</tool_call>"; in the JSON format,
  an answer that begins as calls is calls);
- NONE: text, not read for calls;
- REQUIRED and a named function: constrained (structured output) to JSON calls, so every
  model, even one never trained to call tools, answers with valid calls. REQUIRED's
  output is a JSON array of {"name", "arguments"} objects (one at most when
  parallel_tool_calls is false); a named function's is its arguments object alone.
The constraints themselves are built by scheduler_svc.tool_constraints.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

MAX_TOOLS = 128
# Names, descriptions and parameter schemas of one request's tools together.
MAX_TOOLS_BYTES = 65536
# How deep a tool's parameters schema may nest (objects and lists): its copies for the
# constraint are made by recursion, and no real schema comes near.
MAX_SCHEMA_DEPTH = 64
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The tags of a call in the tagged formats (HERMES, GENERIC).
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


class ToolsError(ValueError):
    """A request's tools or tool calls the server refuses; the message is the sentence."""


class ToolChoice(enum.Enum):
    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"
    FUNCTION = "function"  # ValidTools.function_name, once


class ToolFormat(enum.Enum):
    """How a model writes calls, known from its chat template."""

    HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": ...}</tool_call> (Qwen, Hermes)
    JSON = "json"  # the whole answer a call or a list of them (Llama 3, Mistral)
    # The template takes no tools: the server describes them and asks for HERMES.
    GENERIC = "generic"


def tool_format(chat_template: str | None) -> ToolFormat:
    if chat_template is None or not re.search(r"\btools\b", chat_template):
        return ToolFormat.GENERIC
    return ToolFormat.HERMES if "<tool_call>" in chat_template else ToolFormat.JSON


@dataclass(frozen=True, slots=True)
class ToolFunction:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON Schema of the arguments object
    strict: bool = False  # under AUTO, its calls hold to the schema


@dataclass(frozen=True, slots=True)
class ValidTools:
    functions: tuple[ToolFunction, ...]
    choice: ToolChoice
    function_name: str = ""  # ToolChoice.FUNCTION's
    parallel: bool = True  # several calls in one answer
    format: ToolFormat = ToolFormat.HERMES
    # The model's added tokens (text, id), sorted by id: AUTO's calls' grammar lets the
    # text hold them, and takes a tag that is one of them as that token.
    added_tokens: tuple[tuple[str, int], ...] = ()
    # Calls stream as the model writes them (tool_call_stream.py), rather than whole at
    # the end (tool_calls.py).
    streams: bool = False

    @property
    def names(self) -> frozenset[str]:
        return frozenset(function.name for function in self.functions)

    @property
    def reads_calls(self) -> bool:
        return self.choice is not ToolChoice.NONE

    @property
    def constrained(self) -> bool:
        """The whole output is calls (REQUIRED, a named function)."""
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.FUNCTION)

    @property
    def ends_at_first_close(self) -> bool:
        """Without parallel calls, AUTO in a tagged format ends the sample as the first
        call's tag closes (in JSON calls that text would be a string's)."""
        return (
            self.choice is ToolChoice.AUTO
            and not self.parallel
            and self.format is not ToolFormat.JSON
        )

    @property
    def holds_auto_calls(self) -> bool:
        """AUTO with a strict tool: each call the model makes is constrained, the text
        is free (scheduler_svc.tool_constraints)."""
        return self.choice is ToolChoice.AUTO and any(f.strict for f in self.functions)

    def for_template(self) -> list[dict[str, Any]]:
        """The tools as a chat template takes them (transformers' `tools`: OpenAI's shape)."""
        return [
            {
                "type": "function",
                "function": {
                    "name": function.name,
                    "description": function.description,
                    "parameters": function.parameters,
                },
            }
            for function in self.functions
        ]


def valid_tools(
    tools: list[tuple[str, str, str, bool]],
    mode: str,
    function_name: str,
    parallel: bool,
    format: ToolFormat,
    special_texts: tuple[str, ...],
    added_tokens: tuple[tuple[str, int], ...] = (),
) -> ValidTools | None:
    """A request's (name, description, parameters JSON text, strict) tools and its choice,
    checked;
    None without tools and with no choice that needs them. `mode`: "auto", "none",
    "required", or "function" for `function_name`."""
    if not tools:
        if mode in ("required", "function"):
            raise ToolsError(f"tool_choice {_choice_words(mode, function_name)} needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise ToolsError(f"tools holds {len(tools)} tools; at most {MAX_TOOLS}")
    num_bytes = sum(len(part.encode()) for tool in tools for part in tool[:3])
    if num_bytes > MAX_TOOLS_BYTES:
        raise ToolsError(f"tools hold {num_bytes} bytes; at most {MAX_TOOLS_BYTES}")
    functions = []
    for index, (name, description, parameters, strict) in enumerate(tools):
        check_name(f"tools[{index}].name", name)
        if any(f.name == name for f in functions):
            raise ToolsError(f"tools[{index}].name {name!r} is used twice")
        check_no_special_text(f"tools[{index}].description", description, special_texts)
        check_no_special_text(f"tools[{index}].parameters", parameters, special_texts)
        functions.append(ToolFunction(name, description, _parameters(index, parameters), strict))
    if mode == "function" and all(f.name != function_name for f in functions):
        raise ToolsError(
            f"tool_choice.function_name {function_name[:64]!r} is not one of the tools"
        )
    return ValidTools(
        tuple(functions), ToolChoice(mode), function_name, parallel, format, added_tokens
    )


def _parameters(index: int, text: str) -> dict[str, Any]:
    if not text:
        return {"type": "object"}
    too_deep = ToolsError(f"tools[{index}].parameters nests deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        parameters = json.loads(text)
    except ValueError as exc:
        raise ToolsError(f"tools[{index}].parameters is not JSON: {exc}") from None
    except RecursionError:  # nested past json's own limit
        raise too_deep from None
    if _depth(parameters) > MAX_SCHEMA_DEPTH:
        raise too_deep
    if not isinstance(parameters, dict):
        raise ToolsError(f"tools[{index}].parameters must be a JSON object (a JSON Schema)")
    return parameters


def _depth(value: Any) -> int:
    """How deep `value` nests lists and dicts (a scalar: 0), without recursion."""
    deepest, level = 0, [value]
    while level:
        containers = [item for item in level if isinstance(item, dict | list)]
        if not containers:
            break
        deepest += 1
        level = [
            child
            for container in containers
            for child in (container.values() if isinstance(container, dict) else container)
        ]
    return deepest


def call_arguments(field_name: str, text: str) -> dict[str, Any]:
    """A call's arguments in a conversation's history: a JSON object's text."""
    try:
        arguments = json.loads(text) if text else {}
    except (ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        raise ToolsError(f"{field_name} must be a JSON object's text")
    return arguments


def check_name(field_name: str, name: str) -> None:
    """A tool's name, declared or in a past call: what OpenAI allows."""
    if not _NAME.fullmatch(name):
        raise ToolsError(f"{field_name} must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-'")


def check_no_special_text(field_name: str, text: str, special_texts: tuple[str, ...]) -> None:
    """Tool definitions and calls are written into the prompt by the template as JSON, where
    a special token's text could not be kept apart from the template's own (a forged turn
    marker), so they may not hold one."""
    for special in special_texts:
        if special in text:
            raise ToolsError(f"{field_name} holds the special token text {special!r}")


def _choice_words(mode: str, function_name: str) -> str:
    return f"function {function_name[:64]!r}" if mode == "function" else mode.upper()
