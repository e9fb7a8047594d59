"""The one converter between Python values and pagoda.v1 protobuf messages.

Requests are built from keyword arguments (`GenerationOptions`); responses become the frozen
dataclasses of `client.results`. Both clients use only these functions, so a field is
spelled, defaulted and checked in exactly one place. A keyword left out (or None) leaves the
proto field unset, which means the server's default.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict, Unpack

from pagoda.client.chat_messages import Message, set_message, set_tool_options
from pagoda.client.errors import invalid_argument
from pagoda.client.results import (
    Chunk,
    Completion,
    ModelInfo,
    ServerStats,
    TenantStats,
    Timings,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
    WorkerStats,
    join_chunks,
    join_samples,
)
from pagoda.protos import generation_pb2 as pb

__all__ = [
    "Chunk",
    "Completion",
    "GenerationOptions",
    "Message",
    "ModelInfo",
    "ServerStats",
    "TenantStats",
    "Timings",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
    "chat_request",
    "chunk_from_response",
    "generate_request",
    "join_chunks",
    "join_samples",
    "model_info_from_proto",
    "server_stats_from_proto",
    "token_ids_from_response",
    "tokenize_request",
    "detokenize_request",
]


class GenerationOptions(TypedDict, total=False):
    """Keyword arguments shared by generate(), chat() and complete() of both clients."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    logit_bias: Mapping[int, float]  # token id -> bias in [-100, 100] added to its logit
    allowed_token_ids: Sequence[int]  # sample only among these ids (empty: every id)
    banned_token_ids: Sequence[int]  # never sample these ids
    max_new_tokens: int
    min_new_tokens: int
    stop: Sequence[str] | str
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    priority: int
    logprobs: int
    request_id: str
    cache_salt: str  # share cached prompt blocks only with requests of the same salt
    # Structured output, one of: {"json_schema": dict or JSON text}, {"json_object": True},
    # {"regex": str}, {"lark_grammar": str}, {"gbnf_grammar": str}, {"choice": [str, ...]}.
    constraint: Mapping[str, Any]
    # Samples of the one prompt (default 1), sharing its KV; chunks carry their `index`.
    n: int
    # Chat only. Functions the model may call, each OpenAI's {"type": "function", "function":
    # {"name", "description", "parameters"}} or that inner dict alone; parameters is a JSON
    # Schema, a dict or its JSON text.
    tools: Sequence[Mapping[str, Any]]
    # "auto" (the default), "none", "required", or one function to call:
    # {"type": "function", "function": {"name": ...}} or {"name": ...}.
    tool_choice: str | Mapping[str, Any]
    # False: at most one call per turn (the server's default: several).
    parallel_tool_calls: bool
    # True: each call also streams as the model writes it (Chunk.tool_call_deltas).
    stream_tool_calls: bool
    # Chat only. Extra variables for the model's chat template, sent as JSON text, e.g.
    # {"enable_thinking": False} to make Qwen3 answer without thinking.
    chat_template_kwargs: Mapping[str, Any]


_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)
_STOPPING_SCALAR_FIELDS = ("max_new_tokens", "min_new_tokens", "ignore_eos")
_TOP_LEVEL_FIELDS = ("priority", "logprobs", "request_id", "cache_salt", "n")
_CHAT_ONLY_FIELDS = (
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "stream_tool_calls",
    "chat_template_kwargs",
)
_OPTION_NAMES = frozenset(GenerationOptions.__annotations__)

_FINISH_REASON_NAMES = {
    pb.LENGTH: "length",
    pb.STOP: "stop",
    pb.CANCELLED: "cancelled",
    pb.ERROR: "error",
    pb.TOOL_CALLS: "tool_calls",
}


def generate_request(
    prompt: str | Sequence[int], **options: Unpack[GenerationOptions]
) -> pb.GenerateRequest:
    """A GenerateRequest for a text prompt or a list of prompt token ids."""
    request = pb.GenerateRequest()
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, Sequence):
        _extend(request.prompt_token_ids.ids, "prompt", prompt)
    else:
        raise invalid_argument(
            f"prompt must be a string or a list of token ids, not {type(prompt).__name__}"
        )
    _apply_options(request, options)
    return request


def chat_request(
    messages: Iterable[Message], **options: Unpack[GenerationOptions]
) -> pb.ChatRequest:
    """A ChatRequest from the messages (dicts or (role, content) pairs: see `Message`)."""
    request = pb.ChatRequest()
    for index, message in enumerate(messages):
        set_message(request.messages.add(), index, message)
    _apply_options(request, options)
    return request


def tokenize_request(text: str, *, add_special_tokens: bool = False) -> pb.TokenizeRequest:
    if not isinstance(text, str):
        raise invalid_argument(f"text must be a string, not {type(text).__name__}")
    return pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)


def token_ids_from_response(response: pb.TokenizeResponse) -> list[int]:
    return list(response.token_ids)


def detokenize_request(
    token_ids: Sequence[int], *, skip_special_tokens: bool = False
) -> pb.DetokenizeRequest:
    if isinstance(token_ids, str | bytes) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in token_ids
    ):
        raise invalid_argument("token_ids must be a sequence of non-negative ints")
    return pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)


def chunk_from_response(response: pb.GenerateResponse) -> Chunk:
    logprobs = None
    if len(response.logprobs):
        logprobs = [
            TokenLogprob(
                token_id=entry.token_id,
                logprob=entry.logprob,
                top_token_ids=list(entry.top_token_ids),
                top_logprobs=list(entry.top_logprobs),
                token_bytes=entry.token_bytes,
                top_token_bytes=list(entry.top_token_bytes),
            )
            for entry in response.logprobs
        ]
    usage = total_usage = timings = None
    if response.HasField("usage"):
        usage = _usage_from_proto(response.usage)
    if response.HasField("total_usage"):
        total_usage = _usage_from_proto(response.total_usage)
    if response.HasField("timings"):
        timings = Timings(
            queued_ms=response.timings.queued_ms,
            first_token_ms=response.timings.first_token_ms,
            total_ms=response.timings.total_ms,
        )
    return Chunk(
        request_id=response.request_id,
        text=response.text,
        token_ids=list(response.token_ids),
        logprobs=logprobs,
        finish_reason=_finish_reason_name(response.finish_reason),
        usage=usage,
        timings=timings,
        index=response.index,
        total_usage=total_usage,
        tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in response.tool_calls),
        reasoning_text=response.reasoning_text,
        tool_call_deltas=tuple(
            ToolCallDelta(d.index, d.id, d.name, d.arguments) for d in response.tool_call_deltas
        ),
    )


def _usage_from_proto(usage: pb.Usage) -> Usage:
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        num_preemptions=usage.num_preemptions,
        reasoning_tokens=usage.reasoning_tokens,
    )


def model_info_from_proto(message: pb.ModelInfo) -> ModelInfo:
    return _dataclass_from_message(ModelInfo, message)


def server_stats_from_proto(message: pb.ServerStats) -> ServerStats:
    stats = _dataclass_from_message(ServerStats, message)
    workers = [_dataclass_from_message(WorkerStats, worker) for worker in message.workers]
    tenants = [_dataclass_from_message(TenantStats, tenant) for tenant in message.tenants]
    return dataclasses.replace(stats, workers=workers, tenants=tenants)


def _apply_options(request: pb.GenerateRequest | pb.ChatRequest, options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - _OPTION_NAMES)
    if unknown:
        raise TypeError(f"unexpected generation option(s): {', '.join(unknown)}")
    if isinstance(request, pb.ChatRequest):
        set_tool_options(request, options)
        _set_chat_template_kwargs(request, options.get("chat_template_kwargs"))
    else:
        for name in _CHAT_ONLY_FIELDS:
            if options.get(name) is not None:
                raise invalid_argument(f"{name} is an option of chat(), not of generate()")
    for name in _SAMPLING_FIELDS:
        _set_scalar(request.sampling, name, options.get(name))
    for name in _STOPPING_SCALAR_FIELDS:
        _set_scalar(request.stopping, name, options.get(name))
    stop = options.get("stop")
    if stop is not None:
        _extend(request.stopping.stop, "stop", [stop] if isinstance(stop, str) else stop)
    logit_bias = options.get("logit_bias")
    if logit_bias is not None:
        try:
            request.sampling.logit_bias.update(logit_bias)
        except (TypeError, ValueError) as exc:
            raise invalid_argument(f"logit_bias holds an invalid entry ({exc})") from None
    for name in ("allowed_token_ids", "banned_token_ids"):
        token_ids = options.get(name)
        if token_ids is not None:
            _extend(getattr(request.sampling, name), name, token_ids)
    constraint = options.get("constraint")
    if constraint is not None:
        _set_constraint(request.constraint, constraint)
    stop_token_ids = options.get("stop_token_ids")
    if stop_token_ids is not None:
        _extend(request.stopping.stop_token_ids, "stop_token_ids", stop_token_ids)
    for name in _TOP_LEVEL_FIELDS:
        _set_scalar(request, name, options.get(name))


def _set_chat_template_kwargs(request: pb.ChatRequest, kwargs: Any) -> None:
    """The template's extra variables as a JSON object's text; the server checks its size
    and refuses the names it passes itself."""
    if kwargs is None:
        return
    if not isinstance(kwargs, Mapping) or not all(isinstance(name, str) for name in kwargs):
        raise invalid_argument(
            f"chat_template_kwargs must be a dict with string keys, not {kwargs!r:.64}"
        )
    try:
        request.chat_template_kwargs = json.dumps(dict(kwargs), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise invalid_argument(f"chat_template_kwargs is not JSON-serializable ({exc})") from None


def _set_constraint(message: pb.Constraint, constraint: Mapping[str, Any]) -> None:
    if not isinstance(constraint, Mapping) or len(constraint) != 1:
        raise invalid_argument(
            "constraint must be a dict of exactly one kind, e.g. {'regex': '[0-9]+'}"
        )
    ((kind, value),) = constraint.items()
    if kind == "choice":
        _extend(message.choice.choices, "constraint.choice", value)
    elif kind == "json_schema" and not isinstance(value, str):
        message.json_schema = json.dumps(value)
    elif kind in ("json_schema", "json_object", "regex", "lark_grammar", "gbnf_grammar"):
        _set_scalar(message, kind, value)
    else:
        raise invalid_argument(
            f"constraint kind {kind!r} is not one of json_schema, json_object, "
            "regex, lark_grammar, gbnf_grammar, choice"
        )


def _set_scalar(message: Any, name: str, value: Any) -> None:
    if value is None:
        return
    try:
        setattr(message, name, value)
    except (TypeError, ValueError) as exc:
        raise invalid_argument(f"{name}={value!r} is not a valid value ({exc})") from None


def _extend(container: Any, name: str, values: Iterable[Any]) -> None:
    try:
        container.extend(values)
    except (TypeError, ValueError) as exc:
        raise invalid_argument(f"{name} holds an invalid value ({exc})") from None


def _finish_reason_name(value: int) -> str | None:
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    return _FINISH_REASON_NAMES.get(value, f"unknown_{value}")


def _dataclass_from_message(cls: type, message: Any) -> Any:
    values = {}
    for field in dataclasses.fields(cls):
        value = getattr(message, field.name)
        # Repeated fields come back as protobuf containers; hand out plain lists.
        values[field.name] = value if isinstance(value, str | bytes | int | float) else list(value)
    return cls(**values)
