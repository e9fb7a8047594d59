"""While a step runs, the worker keeps saying it is alive: a thread sends the scheduler a
heartbeat and systemd a watchdog keep-alive every `interval_s`, for at most
`hang_timeout_s` of one step.

The server's loop is one thread, and it says nothing while the engine computes. A step
longer than the scheduler's --worker-timeout-s (a 2048-token prefill of a large model on
a CPU) then looked like a lost worker: its requests were recomputed alone and the longest
failed as the culprit; one longer than the unit's WatchdogSec got the worker killed. A
step past `hang_timeout_s` is taken as hung: the pulse goes quiet, and the scheduler's
timeout and systemd's watchdog act as they did before.

The socket is shared under `socket_lock`: the server holds it whenever it uses the socket
and lets go only while the engine computes (`running`), so the two threads never touch
the socket at once (a ZeroMQ socket is not thread-safe).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("pagoda.worker.pulse")


class StepPulse:
    def __init__(
        self,
        beat: Callable[[], None],
        socket_lock: threading.Lock,
        hang_timeout_s: float,
        interval_s: float,
    ) -> None:
        """`beat` sends one heartbeat (and keep-alive); it runs on the pulse's thread with
        `socket_lock` held. A `hang_timeout_s` of 0 never beats."""
        self._beat = beat
        self._socket_lock = socket_lock
        self._hang_timeout_s = hang_timeout_s
        self._interval_s = interval_s
        self._changed = threading.Condition()
        self._step: tuple[int, float] | None = None  # (step id, when it started)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="step-pulse", daemon=True)
        self._thread.start()

    @contextmanager
    def running(self, step_id: int) -> Iterator[None]:
        """Around the engine's work on one step, entered with `socket_lock` held: the lock
        is free for the pulse until the step is done."""
        with self._changed:
            self._step = (step_id, time.monotonic())
            self._changed.notify()
        self._socket_lock.release()
        try:
            yield
        finally:
            self._socket_lock.acquire()
            with self._changed:
                self._step = None
                self._changed.notify()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()

    def _run(self) -> None:
        with self._changed:
            while not self._closed:
                step = self._step
                if step is None or not self._hang_timeout_s:
                    self._changed.wait()
                    continue
                self._changed.wait(self._interval_s)  # woken early by the step's end
                if self._step is not step or self._closed:
                    continue
                step_id, started_s = step
                running_s = time.monotonic() - started_s
                if running_s > self._hang_timeout_s:
                    log.error(
                        "step %d has run for %.0f s, past --hang-timeout-s %g: taken as hung, "
                        "no more heartbeats for it",
                        step_id,
                        running_s,
                        self._hang_timeout_s,
                    )
                    while self._step is step and not self._closed:
                        self._changed.wait()
                    continue
                # Never blocks: the server holds the lock only outside steps, and takes it
                # back at the end of one (then this beat is not needed).
                if self._socket_lock.acquire(blocking=False):
                    try:
                        self._beat()
                    finally:
                        self._socket_lock.release()
