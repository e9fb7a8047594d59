"""The body of POST /v1/responses, as pydantic models, and the shapes of its input items.

Field names and defaults are OpenAI's. Unknown fields are ignored, as on the other
endpoints; the fields that need state (previous_response_id, conversation, prompt,
background) or settings the server does not have are declared so that `translation`
refuses them by name, never drops them. `input` items stay plain dicts here: an item of a
type the front does not serve is refused naming `input[i].type`, not failed on its fields.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagoda.openai_front.schemas import TextPart


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputMessage(_Loose):
    """{"type": "message" (may be left out), "role", "content"}; output_text parts are a
    previous response's, sent back."""

    role: str
    content: str | list[TextPart]


class FunctionCallItem(_Loose):
    """A call a previous response made; `call_id` is what its output answers."""

    call_id: str
    name: str
    arguments: str  # a JSON object's text


class FunctionCallOutputItem(_Loose):
    call_id: str
    output: str | list[TextPart]


class ResponsesTool(_Loose):
    """Responses' flat function tool; other types carry none of these fields."""

    type: str
    name: str | None = None
    description: str | None = None
    # A JSON Schema of the arguments. `strict` is chat's, and true when absent (the
    # Responses API's default).
    parameters: Any = None
    strict: bool | None = None


class TextConfig(_Loose):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema"}
    verbosity: str | None = None


class ResponsesRequest(_Loose):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None  # echoed in the response
    max_tool_calls: int | None = Field(default=None, ge=1)  # of built-in tools: none here
    # The chat template's extra variables, as chat completions take them (vLLM's name):
    # {"enable_thinking": false} for Qwen3.
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted and unused: the gRPC API has no use for them.
    user: str | None = None
    safety_identifier: str | None = None
    # Accepted whatever its value: nothing is stored, the response says "store": false.
    store: bool | None = None
    # Refused when set (see translation): state, background work, settings not served.
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
