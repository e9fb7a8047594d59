"""The worker's busy fraction (metrics.WorkerBusy): the sum of its steps' own time over a
window of wall time, on a clock the test moves."""

from __future__ import annotations

import pytest

from pagoda.scheduler_svc.metrics import Metrics, WorkerBusy


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_no_step_yet_is_zero():
    assert WorkerBusy(clock=Clock()).fraction() == 0.0


def test_steps_back_to_back_with_gaps_give_their_share_of_the_wall_time():
    clock = Clock()
    busy = WorkerBusy(window_s=10.0, clock=clock)
    for _ in range(100):  # 10 ms steps with 2.5 ms between them: 80 % busy
        clock.now_s += 0.010
        busy.record(0.010)
        clock.now_s += 0.0025
    assert busy.fraction() == pytest.approx(0.8, rel=0.01)
    assert busy.total_s == pytest.approx(1.0)


def test_only_the_last_window_counts_and_an_idle_worker_falls_to_zero():
    clock = Clock()
    busy = WorkerBusy(window_s=1.0, clock=clock)
    for _ in range(200):  # 2 s fully busy
        clock.now_s += 0.010
        busy.record(0.010)
    assert busy.fraction() == pytest.approx(1.0, rel=0.02)
    clock.now_s += 0.5  # half the window idle
    assert busy.fraction() == pytest.approx(0.5, rel=0.05)
    clock.now_s += 1.0
    assert busy.fraction() == 0.0
    assert busy.total_s == pytest.approx(2.0)  # the total is never reset


def test_more_busy_time_than_wall_time_is_clamped_to_one():
    clock = Clock()
    busy = WorkerBusy(window_s=1.0, clock=clock)
    for _ in range(30):  # the worker's clock and ours disagree
        clock.now_s += 0.1
        busy.record(0.2)
    assert busy.fraction() == 1.0


def test_metrics_count_worker_seconds_and_scrape_the_fraction():
    clock = Clock()
    metrics = Metrics(clock=clock)
    metrics.watch(lambda: None, lambda: True)  # type: ignore[arg-type, return-value]
    for _ in range(4):  # 10 ms steps, 10 ms apart
        clock.now_s += 0.01
        metrics.observe_step(
            schedule_s=0.001,
            transport_s=0.001,
            forward_s=0.009,
            worker_s=0.01,
            num_prefill_tokens=0,
            num_decode_tokens=8,
        )
        clock.now_s += 0.01
    assert metrics.registry.get_sample_value("pagoda_worker_busy_seconds_total") == (
        pytest.approx(0.04)
    )
    assert metrics.worker_busy.fraction() == pytest.approx(0.5, rel=0.05)
