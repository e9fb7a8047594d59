"""The benchmarks' local service on CPUs of its own (suite_service.split_cpus, cpus=)."""

from __future__ import annotations

import os
import sys

import pytest

from benchmarks import suite_service
from benchmarks.suite_service import LocalService, split_cpus


@pytest.mark.parametrize(
    ("cpus", "service", "client"),
    [
        ({0, 1}, {0}, {1}),
        ({0, 1, 2}, {0, 1}, {2}),
        ({2, 3, 6, 7}, {2, 3}, {6, 7}),
    ],
)
def test_split_cpus_gives_the_load_generator_the_last_half(monkeypatch, cpus, service, client):
    monkeypatch.setattr(suite_service.os, "sched_getaffinity", lambda pid: set(cpus))
    assert split_cpus() == (frozenset(service), frozenset(client))


def test_one_cpu_is_not_split(monkeypatch):
    monkeypatch.setattr(suite_service.os, "sched_getaffinity", lambda pid: {5})
    assert split_cpus() is None


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pinned_service_runs_its_program_on_its_cpus_only(tmp_path, pinned):
    mine = os.sched_getaffinity(0)
    cpus = frozenset({max(mine)}) if pinned else None
    service = LocalService(worker_model="dummy", device="cpu", model_dir=str(tmp_path), cpus=cpus)
    try:
        program = "import os, sys; print(sorted(os.sched_getaffinity(0)), sys.argv[1:])"
        argv = [sys.executable, "-c", program, "x"]
        process = service._spawn(argv, "probe")
        assert process.wait(timeout=60) == 0
        (log,) = service.run_dir.glob("*-probe.log")
        expected = sorted(cpus) if pinned else sorted(mine)
        assert log.read_text().strip() == f"{expected} ['x']"
    finally:
        service.cleanup()
