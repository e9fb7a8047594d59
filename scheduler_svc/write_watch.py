"""The watch on stream writes: a write that its client does not take within a time limit
(its HTTP/2 flow-control window stays full: it stopped reading) is ended.

One sweep over the writes in progress, a few times per limit, instead of a timer per
message: at 256 streams an `asyncio.timeout` scope around every write cost the event loop
about 7% of its time (py-spy), the loop that also plans the worker's steps. A write is
ended as `asyncio.timeout` ends one: its task is cancelled at the pending await, and the
cancellation becomes StalledWrite there. The limit is kept to within one sweep interval.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

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
