"""gpu_worker/step_pulse.py: heartbeats while a step runs, none outside one, none past the
hang timeout, and the socket lock handed over only for the step."""

from __future__ import annotations

import logging
import threading

import pytest

from pagoda.gpu_worker.config import parse_config
from pagoda.gpu_worker.step_pulse import StepPulse


class Recorder:
    """What happened, in order: beats (each checks it holds the lock) and the hung log."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.events: list[str] = []
        self.beat_seen = threading.Event()
        self.hung_seen = threading.Event()

    def beat(self) -> None:
        assert self.lock.locked()  # the pulse holds it while it sends
        self.events.append("beat")
        self.beat_seen.set()

    def handler(self) -> logging.Handler:
        recorder = self

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                recorder.events.append("hung")
                recorder.hung_seen.set()

        return Handler()


def test_beats_only_while_a_step_runs_and_takes_the_lock_back():
    lock = threading.Lock()
    recorder = Recorder(lock)
    lock.acquire()  # as the server holds it outside steps
    pulse = StepPulse(recorder.beat, lock, hang_timeout_s=60, interval_s=0.01)
    try:
        with pulse.running(step_id=1):
            assert recorder.beat_seen.wait(10), "no heartbeat during the step"
        assert lock.locked()  # held again by this thread: the pulse cannot send now
        num_beats = len(recorder.events)
        assert not lock.acquire(timeout=0.05)
        assert len(recorder.events) == num_beats  # and nothing was sent outside the step
    finally:
        pulse.close()
        lock.release()


def test_a_step_past_the_hang_timeout_gets_no_more_beats():
    lock = threading.Lock()
    recorder = Recorder(lock)
    handler = recorder.handler()
    logging.getLogger("pagoda.worker.pulse").addHandler(handler)
    lock.acquire()
    pulse = StepPulse(recorder.beat, lock, hang_timeout_s=0.2, interval_s=0.01)
    try:
        with pulse.running(step_id=7):
            assert recorder.hung_seen.wait(10), "the step was never taken as hung"
            recorder.beat_seen.clear()
            assert not recorder.beat_seen.wait(0.1)
        assert "beat" in recorder.events
        assert "beat" not in recorder.events[recorder.events.index("hung") :]
        # The next step is vouched for again.
        with pulse.running(step_id=8):
            assert recorder.beat_seen.wait(10)
    finally:
        pulse.close()
        lock.release()
        logging.getLogger("pagoda.worker.pulse").removeHandler(handler)


def test_a_zero_hang_timeout_never_beats():
    lock = threading.Lock()
    recorder = Recorder(lock)
    lock.acquire()
    pulse = StepPulse(recorder.beat, lock, hang_timeout_s=0, interval_s=0.01)
    try:
        with pulse.running(step_id=1):
            assert not recorder.beat_seen.wait(0.1)
    finally:
        pulse.close()
        lock.release()
    assert recorder.events == []


def test_the_flag_and_its_environment_variable():
    endpoint = "--zmq-endpoint=ipc:///tmp/x"
    assert parse_config([endpoint]).hang_timeout_s == 300.0
    assert parse_config([endpoint, "--hang-timeout-s", "0"]).hang_timeout_s == 0.0
    assert parse_config([endpoint], {"PAGODA_WORKER_HANG_TIMEOUT_S": "900"}).hang_timeout_s == 900
    with pytest.raises(SystemExit):
        parse_config([endpoint, "--hang-timeout-s", "-1"])
