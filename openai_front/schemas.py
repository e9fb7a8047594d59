"""The request bodies of the OpenAI API that the front accepts, as pydantic models.

Field names and defaults are OpenAI's (temperature 1, top_p 1, n 1); the extensions that
vLLM and SGLang also take (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
cache_salt, allowed_token_ids, return_token_ids) and Pagoda's own banned_token_ids sit beside
them. Unknown fields are ignored, as vLLM does, so clients that send
newer fields keep working; fields the gRPC API cannot honour yet are refused in
`translation`, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Stop = str | list[str] | None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    user: str | None = None  # accepted; the gRPC API has no use for it
    # Extensions shared with vLLM and SGLang.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None
    allowed_token_ids: list[int] | None = None
    # Pagoda's: vLLM bans strings (bad_words), the gRPC API bans ids.
    banned_token_ids: list[int] | None = None
    # vLLM's: each choice (each stream event's) carries its token ids as `token_ids`.
    return_token_ids: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # a JSON object's text, as the model wrote it


class AssistantToolCall(BaseModel):
    """An assistant message's call of a tool, as a response gave it."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None
    # A "tool" message: the call it answers; the tool's (or a participant's) name.
    tool_call_id: str | None = None
    name: str | None = None
    # An assistant message's thinking, as a response's reasoning_content gave it (or its
    # `reasoning`, the name vLLM moves to; one of the two).
    reasoning_content: str | None = None
    reasoning: str | None = None


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    # A JSON Schema of the arguments (None: any object); any JSON value is passed on as
    # text and the scheduler checks it. tool_choice "required" or a named function holds
    # every call to its schema; under "auto" a `strict` function's calls are held to it
    # (docs/operations.md, "The OpenAI-compatible front").
    parameters: Any = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    function: Function | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # The deprecated forms of tools and tool_choice: refused, naming their successors.
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM's: extra variables for the chat template, e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None


Endpoint = Literal["completions", "chat"]


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a prompt's token ids (and, asked for, their pieces)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize: token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
