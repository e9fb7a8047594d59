"""An asyncio event loop on a thread of its own, so that blocking code can await coroutines."""

from __future__ import annotations

import _thread
import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import CancelledError
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """A private event loop running on a daemon thread until `stop()`.

    `run` and `call_soon` may be called from any number of threads at once; `run` must not be
    called from the loop's own thread (it would wait for itself). Everything the loop owns
    (here: one grpc.aio channel and its calls) is touched only on that thread.
    """

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        # Guards `_stopped` against a `run` that schedules work after `stop` stopped the loop.
        # Re-entrant: a garbage collection inside the guarded region may run a dropped
        # stream's finalizer on this very thread, and that finalizer calls `call_soon`.
        self._lock = threading.RLock()
        self._stopped = False
        self._last: Coroutine[Any, Any, object] | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the loop and return its result or raise its exception (a task
        cancelled by `stop` raises concurrent.futures.CancelledError).

        Anything that interrupts the wait (KeyboardInterrupt) cancels the coroutine's task
        before it propagates, so an RPC it awaits is cancelled too, even when it lands
        between scheduling the coroutine and waiting for it. The wait is a bare lock's
        acquire, a C call: a Ctrl-C raised inside Python-level locking code (a
        concurrent.futures.Future's Condition, as `future.result()` used here) could leave
        that lock held, and the loop thread, next to take it, would hang the exit.
        """
        finished = _thread.allocate_lock()
        finished.acquire()
        task: list[asyncio.Task[T]] = []

        def start() -> None:
            task.append(self._loop.create_task(coroutine))
            task[0].add_done_callback(lambda _: finished.release())

        try:
            if not self.call_soon(start):
                coroutine.close()
                # The type grpc raises for a call on a closed channel.
                raise ValueError(f"{self._thread.name} is closed")
            finished.acquire()
        except BaseException:
            self.call_soon(lambda: task and task[0].cancel())
            raise
        if task[0].cancelled():
            raise CancelledError
        return task[0].result()

    def call_soon(self, callback: Callable[[], object]) -> bool:
        """Schedule `callback` on the loop without waiting; False once the loop is stopped."""
        with self._lock:
            if self._stopped:
                return False
            self._loop.call_soon_threadsafe(callback)
            return True

    def stop(self, last: Coroutine[Any, Any, object] | None = None) -> None:
        """Stop the loop and join its thread; idempotent, and safe from the loop's own thread.

        Tasks still pending are cancelled and awaited, then `last` (e.g. closing a channel)
        runs, then the loop closes.
        """
        with self._lock:
            if self._stopped:
                if last is not None:
                    last.close()
                return
            self._stopped = True
            self._last = last
            self._loop.call_soon_threadsafe(self._loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            try:
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                if self._last is not None:
                    self._loop.run_until_complete(self._last)
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                self._loop.close()
