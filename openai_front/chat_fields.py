"""The fields chat completions and the Responses API both pass on to the gRPC Chat call, in
the client's keywords: function tools, tool_choice and parallel_tool_calls, a
structured-output format as the constraint, and text parts joined. Pure: no I/O; what the
gRPC API cannot express is refused naming its field, the rest is the scheduler's to check.
"""

from __future__ import annotations

import json
from typing import Any

from pagoda.openai_front.errors import FrontError, invalid, unsupported, unsupported_parameter


def format_constraint(
    kind: Any, schema: Any, param: str, schema_param: str
) -> dict[str, Any] | None:
    """A structured-output format (chat's response_format, the Responses API's
    text.format) as a gRPC constraint; None for plain text. The scheduler compiles the
    schema (an invalid one is its INVALID_ARGUMENT, so a 400)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise invalid(f"{schema_param} must be a JSON Schema object", param)
        return {"json_schema": schema}
    raise unsupported(param, f"of type {kind!r}")


def tool_options(
    tools: list[dict[str, str]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    stream: bool,
) -> dict[str, Any]:
    """tools, tool_choice and parallel_tool_calls as the client's keywords, the unset ones
    left out (the scheduler's defaults). A streamed response with tools that may be called
    streams the calls too (stream_tool_calls), as OpenAI's do; a whole one gets them whole."""
    options = {
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel_tool_calls,
        "stream_tool_calls": (stream and bool(tools) and tool_choice != "none") or None,
    }
    return {name: value for name, value in options.items() if value is not None}


def function_tool(
    name: str, description: str | None, parameters: Any, strict: bool
) -> dict[str, Any]:
    """One function tool as the client takes it: its parameters as JSON text (whatever JSON
    value was given: the scheduler checks it)."""
    out: dict[str, Any] = {"name": name, "strict": strict}
    if description is not None:
        out["description"] = description
    if parameters is not None:
        out["parameters"] = json.dumps(parameters)
    return out


def not_a_function(param: str, kind: str) -> FrontError:
    return unsupported_parameter(
        param, f"{param} {kind[:64]!r} is not supported: the gRPC API has function tools only"
    )


def joined_text(parts: list[Any], text_types: tuple[str, ...], param: str) -> str:
    """A content list of text parts (`text_types`) as one text; any other part is refused."""
    texts = []
    for part in parts:
        if part.type not in text_types or part.text is None:
            raise unsupported(param, f"with a part of type {part.type!r}")
        texts.append(part.text)
    return "".join(texts)
