"""pagoda-router under systemd: its unit and settings file, sd_notify (READY=1 once
listening, watchdog keep-alives, STOPPING=1), and serving inside its unit's syscall
filter and address families."""

from __future__ import annotations

import asyncio
import ctypes.util
import os
import shutil
import signal
import subprocess
import sys

import grpc
import pytest

from pagoda.protos import generation_pb2_grpc
from tests.e2e.conftest import REPO_ROOT, free_port, running_service, wait_serving, wait_until
from tests.e2e.test_dummy_service import dummy_continuation, stream_tokens
from tests.ops.sandbox import unit_settings
from tests.ops.test_systemd import UNITS, NotifySocket, last

pytestmark = pytest.mark.slow
UNIT = UNITS / "pagoda-router.service"


def test_the_unit_reads_its_settings_file():
    settings = unit_settings([UNIT])
    assert last(settings, "Type") == "notify" and last(settings, "WatchdogSec")
    assert last(settings, "ExecStart").endswith("--config /etc/pagoda/pagoda-router.toml")
    assert {c.split(":")[0] for c in settings["LoadCredential"]} == {"tls-key"}
    toml = (UNITS / "pagoda-router.toml").read_text()
    assert '# tls_key = "/run/credentials/pagoda-router.service/tls-key"' in toml


def test_the_shipped_settings_file_loads():
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.router", "--config",
         str(UNITS / "pagoda-router.toml"), "--print-config"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert 'backends = "127.0.0.1:50051,127.0.0.1:50052"' in result.stdout


def test_router_notifies_ready_watchdog_and_stopping(tmp_path):
    notify = NotifySocket(tmp_path / "router.notify")
    process = subprocess.Popen(
        [sys.executable, "-m", "pagoda.router", "--listen", f"127.0.0.1:{free_port()}",
         "--backends", f"127.0.0.1:{free_port()}"],
        env=dict(os.environ, NOTIFY_SOCKET=str(notify.path), WATCHDOG_USEC="400000"),
        cwd=REPO_ROOT,
    )  # fmt: skip
    try:
        wait_until(lambda: notify.received("READY=1"), 60, "the router's READY=1")
        notify.messages.clear()
        wait_until(lambda: notify.count("WATCHDOG=1") >= 3, 30, "three watchdog keep-alives")
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: notify.received("STOPPING=1"), 30, "the router's STOPPING=1")
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.skipif(ctypes.util.find_library("seccomp") is None, reason="needs libseccomp2")
def test_router_serves_inside_its_units_syscall_filter(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    with running_service(tmp_path, model="dummy") as replica:
        log_path = tmp_path / "router.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.ops.sandbox", "--unit", str(UNIT), "--",
                 sys.executable, "-m", "pagoda.router", "--listen", address,
                 "--backends", replica.address],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
            )  # fmt: skip
        try:
            wait_serving(address, [process])

            async def one_stream():
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = generation_pb2_grpc.GenerationStub(channel)
                    return await stream_tokens(stub, [5, 6, 7], 4)

            tokens, _ = asyncio.run(one_stream())
            assert tokens == dummy_continuation([5, 6, 7], 4)
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0, log_path.read_text()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
