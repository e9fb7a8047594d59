"""The access log (--access-log): one line per Generate or Chat call when it ends, on the
logger pagoda.access.

The line says who called (the client's request_id, tenant, peer, and the trace id of a
W3C `traceparent` it sent, so the front's, the router's and the scheduler's lines of one
request meet), how it ended (the gRPC status; the finish reason of each sample) and what
it cost (prompt, cached and generated tokens; time to first token and in all, in ms).
Under --log-format json each is a field of its own. Off by default: the step loop logs
each finished request already (pagoda.step_loop, by the scheduler's request id); this line
is the call's, from the servicer, and covers the calls refused before they reached the
loop and those their clients cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

import grpc

from pagoda.scheduler_svc.core import RequestOutput, Usage
from pagoda.scheduler_svc.refusals import answer
from pagoda.scheduler_svc.responses import total_usage

log = logging.getLogger("pagoda.access")

# version-trace_id-parent_id-flags, lower-case hex (W3C Trace Context).
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


def trace_id_of(metadata) -> str:
    """The trace id of the call's `traceparent` metadata, "" without a valid one."""
    for name, value in metadata or ():
        if name == "traceparent" and isinstance(value, str):
            match = _TRACEPARENT.fullmatch(value.strip())
            return match.group(1) if match else ""
    return ""


@dataclass(slots=True)
class CallRecord:
    """One call, filled in as it goes: by the servicer when admitted, and with each
    sample's finishing output."""

    method: str
    peer: str
    trace_id: str
    started_s: float = field(default_factory=time.monotonic)
    request_id: str = ""
    tenant: str = ""
    first_token_ms: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    usages: dict[int, Usage] = field(default_factory=dict)  # by sample index

    def finished(self, output: RequestOutput, index: int) -> None:
        """Sample `index`'s finishing output."""
        if output.finish_reason is not None:
            self.finish_reasons.append(output.finish_reason.name)
        if output.usage is not None:
            self.usages[index] = output.usage
        if output.timings is not None and self.first_token_ms is None:
            self.first_token_ms = output.timings.first_token_ms

    def write(self, code: grpc.StatusCode | None) -> None:
        status = (code or grpc.StatusCode.OK).name
        total_ms = (time.monotonic() - self.started_s) * 1000
        # The call's usage as its last message gives it (total_usage: the prompt once).
        usage = (
            total_usage([self.usages[index] for index in sorted(self.usages)])
            if self.usages
            else Usage(0, 0, 0, 0)
        )
        fields = {
            "method": self.method,
            "request_id": self.request_id,
            "tenant": self.tenant,
            "peer": self.peer,
            "trace_id": self.trace_id,
            "status": status,
            "finish_reasons": ",".join(self.finish_reasons),
            "prompt_tokens": usage.prompt_tokens,
            "cached_prompt_tokens": usage.cached_prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "first_token_ms": None
            if self.first_token_ms is None
            else round(self.first_token_ms, 1),
            "total_ms": round(total_ms, 1),
        }
        log.info(
            "%s %s %s %s tokens %d+%d (%d cached) in %.0f ms, tenant %s, peer %s, trace %s",
            self.method,
            self.request_id or "-",
            status,
            fields["finish_reasons"] or "-",
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_prompt_tokens,
            total_ms,
            self.tenant or "-",
            self.peer,
            self.trace_id or "-",
            extra=fields,
        )


def call_record(method: str, context) -> CallRecord:
    return CallRecord(method, context.peer(), trace_id_of(context.invocation_metadata()))


async def answer_logged(context, handling, record: CallRecord | None) -> None:
    """refusals.answer(), then the call's line when there is a record: its status is the
    one the handler set (OK when none), CANCELLED when the client went away."""
    if record is None:
        await answer(context, handling)
        return
    code = None
    try:
        await answer(context, handling)
        code = context.code()
    except asyncio.CancelledError:
        code = grpc.StatusCode.CANCELLED
        raise
    except Exception:
        code = grpc.StatusCode.UNKNOWN  # grpc answers an escaped exception so
        raise
    finally:
        record.write(code)
