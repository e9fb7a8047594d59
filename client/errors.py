"""Typed client errors: every gRPC status the server returns becomes one PagodaError subclass.

`error_from_rpc` is the one place that maps `grpc.StatusCode` to these classes; the sync
client, the asyncio client, the CLI and the load generator all go through it.
"""

from __future__ import annotations

import grpc


class PagodaError(Exception):
    """A failed call: the gRPC status `code` and the server's one-sentence `details`
    (UNAVAILABLE for a stream cut off before its status, whatever code grpc guessed)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgumentError(PagodaError):
    """A request field is out of range (the sentence names the field and the limit)."""


class ResourceExhaustedError(PagodaError):
    """The server's waiting queue is full; retry later."""


class UnavailableError(PagodaError):
    """No server at the target, no worker connected, the server is draining, or the
    connection or the stream was lost before the call's status (a transport failure: the
    tokens received were real, and the call may be sent again)."""


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


# grpc's sentence for an HTTP/2 stream that ended without a gRPC status (no trailers),
# "Stream removed (<how>)": UNKNOWN after an END_STREAM, INTERNAL after a RST_STREAM. No
# server ends a call that way; a proxy does when the replica behind it went away mid-stream
# (HAProxy 2.6 sends END_STREAM). The transport failed, as when a direct connection is
# reset, which grpc itself reports as UNAVAILABLE.
_CUT_OFF_PREFIX = "Stream removed"
_CUT_OFF_CODES = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})


def error_for_code(code: grpc.StatusCode, details: str) -> PagodaError:
    """The PagodaError subclass for `code` (the base class for codes Pagoda never returns)."""
    details = details.strip() or f"the server returned {code.name} without a reason"
    if code in _CUT_OFF_CODES and details.startswith(_CUT_OFF_PREFIX):
        return UnavailableError(
            grpc.StatusCode.UNAVAILABLE,
            f"the stream was cut off before its status: its server, or a proxy on the way, "
            f"lost it ({details})",
        )
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


def invalid_argument(sentence: str) -> InvalidArgumentError:
    """A request rejected before it is sent, reported like the server's own rejection."""
    return InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, sentence)
