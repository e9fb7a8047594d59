"""While a step runs, the worker keeps saying it is alive: a thread wakes every `interval_s`
and, when it finds a step that has run that long, sends the scheduler a heartbeat and
systemd a watchdog keep-alive, for at most `hang_timeout_s` of one step.

The server's loop is one thread, and it says nothing while the engine computes. A step
longer than the scheduler's --worker-timeout-s (a 2048-token prefill of a large model on
a CPU) then looked like a lost worker: its requests were recomputed alone and the longest
failed as the culprit; one longer than the unit's WatchdogSec got the worker killed. A
step past `hang_timeout_s` is taken as hung: the pulse goes quiet, and the scheduler's
timeout and systemd's watchdog act as they did before. So a step is vouched for within
2 x `interval_s` of its start, then every `interval_s`.

The socket is shared under `socket_lock`: the server holds it whenever it uses the socket
and lets go only while the engine computes (`running`), so the two threads never touch
the socket at once (a ZeroMQ socket is not thread-safe). A step costs the server's thread
a lock release and acquire, and no wake-up of the pulse's: the pulse keeps its own time
(a condition notified per step cost 2-4 points of busy fraction at 10 ms steps).
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
        # The step running, (step id, when it started), or None; set by the server's
        # thread, read by the pulse's (one reference, replaced whole).
        self._step: tuple[int, float] | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-pulse", daemon=True)
        if hang_timeout_s:
            self._thread.start()

    @contextmanager
    def running(self, step_id: int) -> Iterator[None]:
        """Around the engine's work on one step, entered with `socket_lock` held: the lock
        is free for the pulse until the step is done."""
        self._step = (step_id, time.monotonic())
        self._socket_lock.release()
        try:
            yield
        finally:
            self._socket_lock.acquire()
            self._step = None

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        hung: tuple[int, float] | None = None  # the step last reported as hung
        while not self._closed.wait(self._interval_s):
            step = self._step
            if step is None or step is hung:
                continue
            step_id, started_s = step
            running_s = time.monotonic() - started_s
            if running_s < self._interval_s:
                continue  # a short step says nothing: its result comes soon
            if running_s > self._hang_timeout_s:
                hung = step
                log.error(
                    "step %d has run for %.0f s, past --hang-timeout-s %g: taken as hung, "
                    "no more heartbeats for it",
                    step_id,
                    running_s,
                    self._hang_timeout_s,
                )
                continue
            # Never waits: the server holds the lock outside steps, and takes it back at
            # the end of one (then no beat is needed).
            if self._socket_lock.acquire(blocking=False):
                try:
                    if self._step is step:
                        self._beat()
                finally:
                    self._socket_lock.release()
