"""CurveZMQ between scheduler and worker: an authorized worker serves, a worker with an
unknown key is refused without disturbing it, and bad key settings stop a process."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import pytest

from pagoda.common import curve
from pagoda.protos import generation_pb2
from tests.e2e.conftest import REPO_ROOT, running_service, stop_process, wait_until
from tests.e2e.test_dummy_service import dummy_continuation, many_streams, prompts

pytestmark = pytest.mark.slow


@pytest.fixture
def keys(tmp_path):
    """Key pairs for the scheduler, a worker and an intruder; only the worker is authorized."""
    directory = tmp_path / "keys"
    for name in ("scheduler", "worker", "intruder"):
        assert curve.main([str(directory), name]) == 0
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(directory / "worker.key", authorized)
    assert (directory / "worker.key_secret").stat().st_mode & 0o077 == 0
    return directory, authorized


def worker_curve_args(directory, name: str) -> list[str]:
    return [
        "--zmq-curve-secret-key",
        str(directory / f"{name}.key_secret"),
        "--zmq-curve-server-key",
        str(directory / "scheduler.key"),
    ]


def assert_serves_exactly(service) -> None:
    batch = prompts(4)
    results = asyncio.run(many_streams(service.address, batch, 12))
    for prompt_ids, (tokens, finish) in zip(batch, results, strict=True):
        assert finish == generation_pb2.LENGTH
        assert tokens == dummy_continuation(prompt_ids, 12)


def test_authorized_worker_serves_and_an_unknown_key_is_refused(tmp_path, keys):
    directory, authorized = keys
    scheduler_args = [
        "--zmq-curve-secret-key",
        str(directory / "scheduler.key_secret"),
        "--zmq-curve-authorized-keys",
        str(authorized),
    ]
    with running_service(
        tmp_path,
        model="dummy",
        worker_args=worker_curve_args(directory, "worker"),
        scheduler_args=scheduler_args,
    ) as service:
        assert_serves_exactly(service)
        incarnation = service.stats().worker_incarnation_id
        intruder = subprocess.Popen(
            [sys.executable, "-m", "pagoda.gpu_worker", "--model", "dummy",
             "--zmq-endpoint", service.endpoint, *worker_curve_args(directory, "intruder")],
            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_until(
                lambda: "refused a ZeroMQ peer" in (tmp_path / "scheduler.log").read_text(),
                60,
                "the scheduler to refuse the intruder's key",
            )
            stats = service.stats()
            assert stats.worker_connected and stats.worker_incarnation_id == incarnation
            assert_serves_exactly(service)
        finally:
            stop_process(intruder)


def test_bad_curve_settings_stop_both_processes_with_a_sentence(tmp_path, keys):
    directory, authorized = keys
    scheduler = subprocess.run(
        [sys.executable, "-m", "pagoda.scheduler_svc", "--zmq-endpoint", f"ipc://{tmp_path}/s.sock",
         "--zmq-curve-secret-key", str(directory / "scheduler.key"),
         "--zmq-curve-authorized-keys", str(authorized)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert scheduler.returncode == 2
    assert "holds no secret key" in scheduler.stderr
    half = subprocess.run(
        [sys.executable, "-m", "pagoda.gpu_worker", "--model", "dummy",
         "--zmq-curve-secret-key", str(directory / "worker.key_secret")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert half.returncode == 2
    assert "--zmq-curve-server-key go together" in half.stderr
