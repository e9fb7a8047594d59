"""Typed client errors: every gRPC status the server returns becomes one PagodaError subclass.

`error_from_rpc` is the one place that maps `grpc.StatusCode` to these classes; the sync
client, the asyncio client, the CLI and the load generator all go through it.
"""

from __future__ import annotations

import grpc


class PagodaError(Exception):
    """A failed call: the gRPC status `code` and the server's one-sentence `details`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgumentError(PagodaError):
    """A request field is out of range (the sentence names the field and the limit)."""


class ResourceExhaustedError(PagodaError):
    """The server's waiting queue is full; retry later."""


class UnavailableError(PagodaError):
    """No server at the target, no worker connected, or the server is draining."""


class DeadlineExceededError(PagodaError):
    """The call's deadline passed before it finished."""


class RequestCancelledError(PagodaError):
    """The call was cancelled (by the server while draining, or by a cancel elsewhere)."""


class UnauthenticatedError(PagodaError):
    """The API key is missing or wrong."""


class InternalError(PagodaError):
    """The server or its worker failed on this request."""


_ERROR_CLASS_BY_CODE: dict[grpc.StatusCode, type[PagodaError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: RequestCancelledError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: UnauthenticatedError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.DATA_LOSS: InternalError,
}


def error_for_code(code: grpc.StatusCode, details: str) -> PagodaError:
    """The PagodaError subclass for `code` (the base class for codes Pagoda never returns)."""
    details = details.strip() or f"the server returned {code.name} without a reason"
    return _ERROR_CLASS_BY_CODE.get(code, PagodaError)(code, details)


def error_from_rpc(exc: grpc.RpcError) -> PagodaError:
    """Turn a failed gRPC call (sync or grpc.aio) into its PagodaError."""
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return error_for_code(code, details or "")
