"""Threads of their own for one kind of call, with a bound on the calls queued or running.

Tokenize runs its big texts here (security review N6): one thread, so a flood of them
holds at most one core's worth of tokenizer time and never the threads Generate's and
Chat's validation run on; past the bound a call is refused at once instead of queueing
without end, each queued one holding its request's text.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class ExecutorFull(Exception):
    """`max_calls` calls are queued or running; the caller's refusal names its setting."""


class BoundedExecutor:
    """Runs `function(*args)` on `num_threads` threads; at most `max_calls` at once,
    queued or running. A call stays counted until its function returns, even when the
    awaiting coroutine was cancelled first (a queued one is then dropped, a running one
    cannot be stopped), so the bound holds for the work itself."""

    def __init__(self, max_calls: int, *, num_threads: int, thread_name_prefix: str) -> None:
        self.max_calls = max_calls
        self._threads = ThreadPoolExecutor(num_threads, thread_name_prefix=thread_name_prefix)
        self._lock = threading.Lock()  # the count drops on a worker thread
        self._num_calls = 0

    @property
    def num_calls(self) -> int:
        """Calls queued or running now."""
        return self._num_calls

    async def run(self, function: Callable[..., T], *args) -> T:
        with self._lock:
            full = self._num_calls >= self.max_calls
            if not full:
                self._num_calls += 1
        if full:
            raise ExecutorFull
        future = self._threads.submit(function, *args)
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def _done(self, _: Future) -> None:
        with self._lock:
            self._num_calls -= 1
