"""How an RPC is refused: a gRPC status and one human sentence, counted in the metrics.

Handlers raise a Refused; `answer`, at the top of each RPC, turns it into the call's
status. A stream whose client stopped reading is ended by write_watch's `end_stalled`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

import grpc

from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.write_watch import end_stalled

# A refusal's sentence is cut here: whatever it quotes, it stays far below the 8 KiB of
# metadata a client accepts (security review N11).
MAX_DETAILS_CHARS = 1024

T = TypeVar("T")


class Refused(Exception):
    """Ends an RPC with a status and one sentence: raised under a handler, answered at its
    top by `answer`, which sets the status instead of calling context.abort. The exception
    abort raises stays in a reference cycle with grpc.aio's RPC state and every frame it
    passed through, the request in them, until the cyclic collector runs: with the tuned
    collector (gc_tuning) 1,000 refused 4 MiB calls held 4 GB (security review N1). So it
    is never raised inside an `except ... as exc` block either (that frame would hold exc).
    """

    def __init__(self, code: grpc.StatusCode, sentence: str, *, stalled: bool = False) -> None:
        super().__init__(sentence)
        self.code = code
        self.sentence = sentence
        self.stalled = stalled  # the client stopped reading: see end_stalled


class Undecodable:
    """Stands in for a request whose bytes are not a valid message of its type."""

    def __init__(self, type_name: str) -> None:
        self.sentence = f"the request is not a valid {type_name} message"


def refusal(
    metrics: Metrics, code: grpc.StatusCode, sentence: str, *, stalled: bool = False
) -> Refused:
    """The refusal to raise, counted; its sentence within MAX_DETAILS_CHARS."""
    metrics.observe_error(code.name)
    if len(sentence) > MAX_DETAILS_CHARS:
        sentence = sentence[:MAX_DETAILS_CHARS] + "..."
    return Refused(code, sentence, stalled=stalled)


async def answer(context, handling: Awaitable[T]) -> T | None:
    """Await a handler's work; a refusal becomes the RPC's status and None."""
    try:
        return await handling
    except Refused as refused:
        code, sentence, stalled = refused.code, refused.sentence, refused.stalled
    # Past the except block, the refusal, its traceback and the frames it holds (the
    # request's) are freed by reference counting.
    if stalled:
        await end_stalled(context, code, sentence)
    context.set_code(code)
    context.set_details(sentence)
    return None
