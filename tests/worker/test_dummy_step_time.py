"""--dummy-step-ms: the dummy engine's simulated forward time (no timing is asserted: the
sleep it asks for is recorded instead)."""

from __future__ import annotations

import pytest

from pagoda.gpu_worker import dummy_engine
from pagoda.gpu_worker.config import parse_config
from pagoda.gpu_worker.dummy_engine import DummyEngine
from pagoda.protos import step_pb2
from tests.worker.conftest import run_plan


def one_prefill() -> step_pb2.StepPlan:
    plan = step_pb2.StepPlan(step_id=1)
    plan.new_sequences.add(seq_id=1, num_prompt_tokens=3)
    plan.seq_ids.append(1)
    plan.start_positions.append(0)
    plan.sample.append(True)
    plan.token_offsets.extend([0, 3])
    plan.token_ids.extend([5, 6, 7])
    plan.block_offsets.extend([0, 1])
    plan.block_ids.append(0)
    return plan


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    asked: list[float] = []
    monkeypatch.setattr(dummy_engine.time, "sleep", asked.append)
    return asked


def test_each_compute_sleeps_its_step_time_before_it_samples(sleeps):
    engine = DummyEngine(step_ms=50.0)
    result = run_plan(engine, one_prefill())
    assert len(result.token_ids) == 1 and not result.step_error
    assert sleeps == [0.050]


def test_no_step_time_no_sleep(sleeps):
    run_plan(DummyEngine(), one_prefill())
    assert sleeps == []


def test_the_flag_and_its_environment_variable():
    endpoint = "--zmq-endpoint=ipc:///tmp/x"
    assert parse_config([endpoint, "--model", "dummy"]).dummy_step_ms == 0.0
    assert parse_config([endpoint, "--dummy-step-ms", "10"]).dummy_step_ms == 10.0
    environ = {"PAGODA_WORKER_DUMMY_STEP_MS": "2.5"}
    assert parse_config([endpoint], environ).dummy_step_ms == 2.5
    with pytest.raises(SystemExit):
        parse_config([endpoint, "--dummy-step-ms", "-1"])
