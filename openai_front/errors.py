"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP
status mapped once from the scheduler's gRPC status (through the client's PagodaError)."""

from __future__ import annotations

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
    """One failed HTTP request: its status and OpenAI's four error fields."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

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
    return FrontError(status, error.details, kind, None, code)


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
