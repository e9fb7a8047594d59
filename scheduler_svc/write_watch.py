"""The watch on stream writes: a write that its client does not take within a time limit
(its HTTP/2 flow-control window stays full: it stopped reading) is ended.

One sweep over the writes in progress, a few times per limit, instead of a timer per
message: at 256 streams an `asyncio.timeout` scope around every write cost the event loop
about 7% of its time (py-spy), the loop that also plans the worker's steps. A write is
ended as `asyncio.timeout` ends one: its task is cancelled at the pending await, and the
cancellation becomes StalledWrite there. The limit is kept to within one sweep interval.
`end_stalled` then ends such a stream (the scheduler's and the router's alike).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc

# How long a stalled stream's status may wait to be sent before its handler gives up.
STALLED_ABORT_TIMEOUT_S = 1.0
# Sweeps per time limit: a stalled write is ended between 1 and 1 + 1/SWEEPS_PER_LIMIT
# limits after it began.
SWEEPS_PER_LIMIT = 4
MAX_SWEEP_INTERVAL_S = 1.0


class StalledWrite(Exception):
    """The client took no message for the time limit."""


class WriteWatch:
    def __init__(self, limit_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_s = limit_s
        self._clock = clock
        self._interval_s = min(MAX_SWEEP_INTERVAL_S, limit_s / SWEEPS_PER_LIMIT)
        self._started_s: dict[asyncio.Task, float] = {}  # writes in progress, by task
        self._ended: set[asyncio.Task] = set()  # cancelled by a sweep, not yet told
        self._sweeper: asyncio.Task | None = None

    async def write(self, write: Awaitable) -> None:
        """Await `write`; StalledWrite if it lasts beyond the limit. Other cancellations
        (the client left, a deadline) pass through as they are."""
        task = asyncio.current_task()
        assert task is not None
        self._started_s[task] = self._clock()
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep(), name="write-watch")
        try:
            await write
        except asyncio.CancelledError:
            if task not in self._ended:
                raise
            self._ended.discard(task)
            task.uncancel()
            raise StalledWrite from None
        finally:
            del self._started_s[task]

    @property
    def stalled_sentence(self) -> str:
        """What a client whose stream was ended for not reading is told."""
        return f"the client took no message for {self.limit_s:g} s; the stream was ended"

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            began_by_s = self._clock() - self.limit_s
            for task, started_s in list(self._started_s.items()):
                if started_s <= began_by_s and task not in self._ended:
                    self._ended.add(task)
                    task.cancel()


async def end_stalled(context, code: grpc.StatusCode, sentence: str) -> None:
    """End a stream its client stopped reading. The status queues behind the message
    the client does not take, so it can wait for good (and grpc.aio cannot reset one
    stream): bounded, then the handler ends as cancelled, giving back its request and
    its RPC slot; the HTTP/2 stream lasts until the client's connection closes."""
    try:
        await asyncio.wait_for(context.abort(code, sentence), STALLED_ABORT_TIMEOUT_S)
    except (TimeoutError, grpc.aio.InternalError):
        # InternalError: grpc refuses the status while the write is still pending
        # (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS); expected, one per stalled stream, so
        # it is not left to grpc.aio to log with a traceback (security review N7).
        pass
    raise asyncio.CancelledError
