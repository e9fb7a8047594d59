"""What a Chat's tool calls must be, as structured output (scheduler_svc.tools checks
the tools): REQUIRED's list of calls and a named function's arguments as JSON schemas, and
AUTO's calls, when a tool is strict, as a lazy grammar. Each arguments schema is closed
where it leaves other properties open (`closed`), and keeps its own references where it
is moved under another document (`moved_under`)."""

from __future__ import annotations

import json
from typing import Any

from pagoda.scheduler_svc.grammars import JSON_OPTIONS, ValidConstraint, id_ranges
from pagoda.scheduler_svc.tools import CALL_CLOSE, CALL_OPEN, ToolChoice, ToolFormat, ValidTools


def tool_constraint(tools: ValidTools) -> ValidConstraint | None:
    """The structured output of REQUIRED, of a named function, and of AUTO's calls when
    it holds them; None otherwise. The arguments are closed objects where the schema
    leaves that open (as vLLM's strict JSON mode, and OpenAI's strict functions): a
    call names only declared parameters, and cannot run on inventing new ones until
    max_new_tokens."""
    if tools.choice is ToolChoice.FUNCTION:
        (index,) = (i for i, f in enumerate(tools.functions) if f.name == tools.function_name)
        return _arguments_constraint(tools, index)
    if tools.holds_auto_calls:
        if tools.format is ToolFormat.JSON:
            return ValidConstraint("lark_grammar", _auto_json_calls_grammar(tools), "tools")
        return ValidConstraint("lark_grammar", _auto_calls_grammar(tools), "tools")
    if tools.choice is not ToolChoice.REQUIRED:
        return None
    calls = {
        **_call_schemas(tools, strict_only=False),
        "type": "array",
        "minItems": 1,
    }
    if not tools.parallel:
        calls["maxItems"] = 1
    return ValidConstraint("json_schema", json.dumps(calls), "tools")


def _call_schemas(
    tools: ValidTools, strict_only: bool, keys: tuple[str, ...] = ("arguments",)
) -> dict[str, Any]:
    """The "$defs" and "items" of a list of calls: each one {"name": a tool's,
    "arguments": its closed schema}, or any object for a tool that is not strict when
    `strict_only`; with more `keys`, the arguments under any one of them (Llama writes
    "parameters"). Each tool's schema goes whole under $defs, its own references
    ("#/$defs/...", pydantic's) rewritten to point into it there."""
    schemas = {
        f"tool{index}": moved_under(f"#/$defs/tool{index}", closed(function.parameters))
        if function.strict or not strict_only
        else {"type": "object"}
        for index, function in enumerate(tools.functions)
    }
    call = [
        {
            "type": "object",
            "properties": {
                "name": {"const": function.name},
                key: {"$ref": f"#/$defs/tool{index}"},
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for index, function in enumerate(tools.functions)
        for key in keys
    ]
    return {"$defs": schemas, "items": {"anyOf": call}}


# How templates show past calls (tojson): the separators a call is held to.
_TEMPLATE_JSON = {**JSON_OPTIONS, "item_separator": ", ", "key_separator": ": "}


def _auto_calls_grammar(tools: ValidTools) -> str:
    """AUTO's lazy grammar (llguidance's Lark): any text, and from "<tool_call>" on a
    call as the tagged templates write it ({"name": ..., "arguments": ...}, with
    json.dumps' separators, as a template's tojson shows past calls) until
    "</tool_call>"; then text again, and more calls. Without parallel calls the reader
    ends the sample when the first one closes. The text holds any added token (Qwen's
    <think>; a model's turn markers, as without a grammar) but the opening tag's,
    which opens a call; a tag that is an added token is taken as the token or as its
    spelled text. The text allows EOS wherever it may end; an open call does not."""
    added = dict(tools.added_tokens)
    parts = _call_schemas(tools, strict_only=True)
    call = {"$defs": parts["$defs"], **parts["items"], "x-guidance": _TEMPLATE_JSON}
    in_text = [token_id for text, token_id in tools.added_tokens if text != CALL_OPEN]
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
        lines.append(f"added_token: <[{id_ranges(in_text)}]>")
    return "\n".join(lines)


def _auto_json_calls_grammar(tools: ValidTools) -> str:
    """AUTO's grammar in the JSON format (Llama 3, Mistral), where calls are the whole
    answer: after any added tokens (Mistral's [TOOL_CALLS], Llama's <|python_tag|>), an
    answer is either text, which begins with something other than "{" or "[" (past
    blanks) and then holds anything, added tokens too, or calls: one {"name",
    "arguments" or "parameters"} object (Llama writes the latter), or a list of them (one
    at most without parallel calls), and nothing after them but blanks. As the reader
    tells them apart: an answer that begins with "{" or "[" is read as calls."""
    parts = _call_schemas(tools, strict_only=True, keys=("arguments", "parameters"))
    one = parts["items"]
    calls_list: dict[str, Any] = {"type": "array", "items": one, "minItems": 1}
    if not tools.parallel:
        calls_list["maxItems"] = 1
    calls = {"$defs": parts["$defs"], "anyOf": [one, calls_list], "x-guidance": _TEMPLATE_JSON}
    added_ids = [token_id for _, token_id in tools.added_tokens]
    lead = "added_token* " if added_ids else ""
    # Blanks alone, or words: text that began as text may hold added tokens after it.
    words = "WORDS (added_token TEXT)*" if added_ids else "WORDS"
    lines = [
        "%llguidance {}",
        f"start: {lead}(calls | text)",
        r"BLANKS: /[ \t\n]{0,4}/",
        f"calls: BLANKS %json {json.dumps(calls)} BLANKS",
        f"text: BLANK_TEXT | {words}",
        r"BLANK_TEXT: /\s*/",
        r"WORDS: /\s*[^\s{\[](.|\n)*/",
    ]
    if added_ids:
        lines += [r"TEXT: /(.|\n)*/", f"added_token: <[{id_ranges(added_ids)}]>"]
    return "\n".join(lines)


def argument_constraints(tools: ValidTools) -> list[ValidConstraint]:
    """Each tool's arguments alone, to find which one a REQUIRED constraint that the
    engine refused holds."""
    return [_arguments_constraint(tools, index) for index in range(len(tools.functions))]


def _arguments_constraint(tools: ValidTools, index: int) -> ValidConstraint:
    schema = json.dumps(closed(tools.functions[index].parameters))
    return ValidConstraint("json_schema", schema, f"tools[{index}].parameters")


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
