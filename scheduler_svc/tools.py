"""Tools (function calling) of a Chat request: checked, shown to the model, and what its
output must be.

The model sees a request's tools through its chat template (tool_templates.py: the
template's own `tools`, or for one that takes none, a system message asking for
Hermes-style <tool_call> tags). What the output is depends on tool_choice:
- AUTO: whatever the model writes, read for calls in its template's format
  (scheduler_svc.tool_calls), text streamed until a call may begin; with a strict tool,
  in the tagged formats, each call the model opens is constrained (a lazy grammar: free
  text until "<tool_call>", then a call's JSON until "</tool_call>");
- NONE: text, not read for calls;
- REQUIRED and a named function: constrained (structured output) to JSON calls, so every
  model, even one never trained to call tools, answers with valid calls. REQUIRED's
  output is a JSON array of {"name", "arguments"} objects (one at most when
  parallel_tool_calls is false); a named function's is its arguments object alone.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.scheduler_svc.grammars import ValidConstraint

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
    def holds_auto_calls(self) -> bool:
        """AUTO with a strict tool in a tagged format: each call the model opens is
        constrained, the text around calls is free. The JSON format's calls are the
        whole answer, which some templates open with a special token that a grammar
        cannot see: those stay read, not constrained."""
        return (
            self.choice is ToolChoice.AUTO
            and self.format is not ToolFormat.JSON
            and any(function.strict for function in self.functions)
        )

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

    def constraint(self) -> ValidConstraint | None:
        """The structured output of REQUIRED, of a named function, and of AUTO's calls when
        it holds them; None otherwise. The arguments are closed objects where the schema
        leaves that open (as vLLM's strict JSON mode, and OpenAI's strict functions): a
        call names only declared parameters, and cannot run on inventing new ones until
        max_new_tokens."""
        if self.choice is ToolChoice.FUNCTION:
            (index,) = (i for i, f in enumerate(self.functions) if f.name == self.function_name)
            return self._arguments_constraint(index)
        if self.holds_auto_calls:
            return ValidConstraint("lark_grammar", self._auto_calls_grammar(), "tools")
        if self.choice is not ToolChoice.REQUIRED:
            return None
        calls = {
            **self._call_schemas(strict_only=False),
            "type": "array",
            "minItems": 1,
        }
        if not self.parallel:
            calls["maxItems"] = 1
        return ValidConstraint("json_schema", json.dumps(calls), "tools")

    def _call_schemas(self, strict_only: bool) -> dict[str, Any]:
        """The "$defs" and "items" of a list of calls: each one {"name": a tool's,
        "arguments": its closed schema}, or any object for a tool that is not strict when
        `strict_only`. Each tool's schema goes whole under $defs, its own references
        ("#/$defs/...", pydantic's) rewritten to point into it there."""
        schemas = {
            f"tool{index}": moved_under(f"#/$defs/tool{index}", closed(function.parameters))
            if function.strict or not strict_only
            else {"type": "object"}
            for index, function in enumerate(self.functions)
        }
        call = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": function.name},
                    "arguments": {"$ref": f"#/$defs/tool{index}"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for index, function in enumerate(self.functions)
        ]
        return {"$defs": schemas, "items": {"anyOf": call}}

    def _auto_calls_grammar(self) -> str:
        """AUTO's lazy grammar (llguidance's Lark): any text, and from "<tool_call>" on a
        call as the tagged templates write it ({"name": ..., "arguments": ...}, with
        json.dumps' separators, as a template's tojson shows past calls) until
        "</tool_call>"; then text again, and more calls. Without parallel calls the reader
        ends the sample when the first one closes. The text holds any added token (Qwen's
        <think>; a model's turn markers, as without a grammar) but the opening tag's,
        which opens a call; a tag that is an added token is taken as the token or as its
        spelled text. The text allows EOS wherever it may end; an open call does not."""
        added = dict(self.added_tokens)
        parts = self._call_schemas(strict_only=True)
        call = {
            "$defs": parts["$defs"],
            **parts["items"],
            "x-guidance": {
                "whitespace_flexible": False,
                "item_separator": ", ",
                "key_separator": ": ",
            },
        }
        in_text = [token_id for text, token_id in self.added_tokens if text != CALL_OPEN]
        opening = ["call_opening"]
        if CALL_OPEN in added:
            opening.append(f"TEXT <[{added[CALL_OPEN]}]>")
        closing = [json.dumps(CALL_CLOSE)]
        if CALL_CLOSE in added:
            closing.append(f"<[{added[CALL_CLOSE]}]>")
        lines = [
            "%llguidance {}",
            "start: part* TEXT",
            "part: call" + (" | TEXT added_token" if in_text else ""),
            r"TEXT: /(.|\n)*/",
            f"call_opening[lazy]: TEXT {json.dumps(CALL_OPEN)}",
            f"opening: {' | '.join(opening)}",
            f"closing: {' | '.join(closing)}",
            r"BLANKS: /[ \t\n]{0,2}/",
            f"call: opening BLANKS %json {json.dumps(call)} BLANKS closing",
        ]
        if in_text:
            lines.append(f"added_token: <[{_id_ranges(in_text)}]>")
        return "\n".join(lines)

    def argument_constraints(self) -> list[ValidConstraint]:
        """Each tool's arguments alone, to find which one a REQUIRED constraint that the
        engine refused holds."""
        return [self._arguments_constraint(index) for index in range(len(self.functions))]

    def _arguments_constraint(self, index: int) -> ValidConstraint:
        schema = json.dumps(closed(self.functions[index].parameters))
        return ValidConstraint("json_schema", schema, f"tools[{index}].parameters")


def _id_ranges(token_ids: list[int]) -> str:
    """Sorted ids as llguidance's token ranges: [1, 2, 3, 7] -> "1-3,7"."""
    ranges: list[list[int]] = []
    for token_id in token_ids:
        if ranges and token_id == ranges[-1][1] + 1:
            ranges[-1][1] = token_id
        else:
            ranges.append([token_id, token_id])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def moved_under(pointer: str, schema: Any) -> Any:
    """`schema` with each local reference ("#...") rewritten for the schema to sit at
    `pointer` of another document."""
    if isinstance(schema, list):
        return [moved_under(pointer, item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {key: moved_under(pointer, value) for key, value in schema.items()}
    reference = schema.get("$ref")
    if isinstance(reference, str) and reference.startswith("#"):
        moved["$ref"] = pointer + reference[1:]
    return moved


# Keywords whose value is a schema, or a list or a map of schemas.
_SUBSCHEMA = ("items", "additionalItems", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed(schema: Any) -> Any:
    """`schema` with additionalProperties false in each object schema that lists properties
    and says nothing of others."""
    if not isinstance(schema, dict):
        return schema
    result = dict(schema)
    for key in _SUBSCHEMA:
        if key in result:
            result[key] = closed(result[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(result.get(key), list):
            result[key] = [closed(item) for item in result[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(result.get(key), dict):
            result[key] = {name: closed(item) for name, item in result[key].items()}
    if (
        "properties" in result
        and "additionalProperties" not in result
        and "patternProperties" not in result
    ):
        result["additionalProperties"] = False
    return result


def valid_tools(
    tools: list[tuple[str, str, str, bool]],
    mode: str,
    function_name: str,
    parallel: bool,
    format: ToolFormat,
    special_texts: tuple[str, ...],
    added_token_ids: Mapping[str, int] | None = None,
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
    added = tuple(sorted((added_token_ids or {}).items(), key=lambda item: item[1]))
    return ValidTools(tuple(functions), ToolChoice(mode), function_name, parallel, format, added)


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
