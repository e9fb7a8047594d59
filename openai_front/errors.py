"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP
status mapped once from the scheduler's gRPC status (through the client's PagodaError)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import grpc

from pagoda.client.errors import PagodaError

# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code).
_BY_GRPC_CODE: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "server_error", "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}
_INTERNAL = (500, "server_error", "internal_error")


@dataclass(slots=True)
class FrontError(Exception):
    """One failed HTTP request: its status and OpenAI's four error fields. `refused_field`:
    the gRPC request field a scheduler's refusal names, from which the app fills `param`
    for the endpoint that was called (`param_for`)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    refused_field: str | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def from_pagoda(error: PagodaError) -> FrontError:
    """The HTTP error for a failed gRPC call, the server's sentence as its message."""
    status, kind, code = _BY_GRPC_CODE.get(error.code, _INTERNAL)
    field = None
    if error.code == grpc.StatusCode.INVALID_ARGUMENT:
        # The scheduler's sentences begin with the field they refuse, as its request
        # spells it: "sampling.temperature must be in [0, 100], got -1".
        match = _LEADING_FIELD.match(error.details)
        field = match.group(1) if match else None
    return FrontError(status, error.details, kind, None, code, field)


# A field of one of the request's nested messages (sampling.temperature), as the
# scheduler's sentences spell it.
_NESTED_FIELD = r"(?:sampling|stopping|constraint|tool_choice)\.[a-z_]+"
_LEADING_FIELD = re.compile(rf"({_NESTED_FIELD}|[a-z_]+)\b")

# A gRPC request field -> the body field of each endpoint family that carries it.
_PARAMS: dict[str, dict[str, str]] = {
    "completions": {"logprobs": "logprobs", "prompt": "prompt", "prompt_token_ids": "prompt"},
    "chat": {"logprobs": "top_logprobs", "prompt": "messages", "messages": "messages"},
    "responses": {
        "logprobs": "top_logprobs",
        "prompt": "input",
        "messages": "input",
        "constraint": "text.format",
        "stopping.max_new_tokens": "max_output_tokens",
    },
}
# The same name on every endpoint that has the field.
_COMMON_PARAMS = {
    "tools": "tools",
    "tool_choice": "tool_choice",
    "chat_template_kwargs": "chat_template_kwargs",
    "stopping.max_new_tokens": "max_tokens",
    "stopping.min_new_tokens": "min_tokens",
    "stopping.stop": "stop",
    "stopping.stop_token_ids": "stop_token_ids",
    "constraint": "response_format",
    "n": "n",
    "cache_salt": "cache_salt",
    "priority": "priority",
}


def param_for(field: str, endpoint: str | None) -> str | None:
    """OpenAI's `param` for a refused gRPC field on `endpoint` (completions, chat or
    responses); None for a field the endpoint has no name for. Sampling knobs keep their
    names (sampling.temperature -> temperature)."""
    head = field.split(".")[0]
    if head == "sampling":
        return field.removeprefix("sampling.")
    key = field if head == "stopping" else head
    return _PARAMS.get(endpoint or "", {}).get(key) or _COMMON_PARAMS.get(key)


_DOTTED_FIELD = re.compile(rf"\b{_NESTED_FIELD}\b")
_LEADING_NAME = re.compile(r"^[a-z_]+(?=[ \[.(])")


def in_endpoint_terms(message: str, endpoint: str | None) -> str:
    """A scheduler's sentence with the gRPC fields it names spelled as `endpoint`'s body
    spells them ("stopping.max_new_tokens" -> "max_tokens", a leading "logprobs" ->
    "top_logprobs" on chat); a field the endpoint has no name for stays as it is."""

    def spelled(match: re.Match) -> str:
        return param_for(match.group(0), endpoint) or match.group(0)

    return _LEADING_NAME.sub(spelled, _DOTTED_FIELD.sub(spelled, message), count=1)


def invalid(message: str, param: str | None = None, code: str | None = None) -> FrontError:
    return FrontError(400, message, "invalid_request_error", param, code)


def unsupported_parameter(param: str, sentence: str) -> FrontError:
    """A field refused, never silently dropped: OpenAI's code for it, `param` naming it."""
    return FrontError(400, sentence, "invalid_request_error", param, "unsupported_parameter")


def unsupported(param: str, what: str) -> FrontError:
    """A field the gRPC API cannot honour yet."""
    return unsupported_parameter(
        param, f"{param} {what} is not supported yet: Pagoda's gRPC API has no such field"
    )


def deprecated(param: str, successor: str) -> FrontError:
    """OpenAI's legacy form of a field that is served under its successor's name."""
    return unsupported_parameter(param, f"{param} is deprecated and not supported: use {successor}")


def model_not_found(model: str) -> FrontError:
    return FrontError(
        404,
        f"The model `{model}` does not exist; GET /v1/models lists the one served",
        "invalid_request_error",
        "model",
        "model_not_found",
    )
