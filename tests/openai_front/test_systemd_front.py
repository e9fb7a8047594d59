"""pagoda-openai under systemd: it speaks sd_notify (READY=1 once listening, watchdog
keep-alives, STOPPING=1) and serves inside its unit's syscall filter and address families."""

from __future__ import annotations

import ctypes.util
import os
import shutil
import signal
import subprocess
import sys

import httpx
import pytest

from tests.e2e.conftest import REPO_ROOT, free_port, running_service, wait_until
from tests.ops.sandbox import unit_settings
from tests.ops.test_systemd import UNITS, NotifySocket, last

pytestmark = pytest.mark.slow
UNIT = UNITS / "pagoda-openai.service"


def test_the_unit_reads_its_settings_file_and_keeps_devices_and_kernel_files_away():
    settings = unit_settings([UNIT])
    assert last(settings, "Type") == "notify" and last(settings, "WatchdogSec")
    assert last(settings, "ExecStart").endswith("--config /etc/pagoda/pagoda-openai.toml")
    assert last(settings, "PrivateDevices") == "yes" and last(settings, "ProcSubset") == "pid"
    assert {c.split(":")[0] for c in settings["LoadCredential"]} == {"tls-key"}
    toml = (UNITS / "pagoda-openai.toml").read_text()
    assert '# tls_key = "/run/credentials/pagoda-openai.service/tls-key"' in toml


def test_the_shipped_settings_file_loads():
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.openai_front", "--config",
         str(UNITS / "pagoda-openai.toml"), "--print-config"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_front_notifies_ready_watchdog_and_stopping(tmp_path):
    notify = NotifySocket(tmp_path / "front.notify")
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "pagoda.openai_front", "--listen", address,
         "--target", f"127.0.0.1:{free_port()}"],
        env=dict(os.environ, NOTIFY_SOCKET=str(notify.path), WATCHDOG_USEC="400000"),
        cwd=REPO_ROOT,
    )  # fmt: skip
    try:
        wait_until(lambda: notify.received("READY=1"), 60, "the front's READY=1")
        # Listening by then: no retry needed.
        assert httpx.get(f"http://{address}/health", timeout=10).status_code == 503
        notify.messages.clear()
        wait_until(lambda: notify.count("WATCHDOG=1") >= 3, 30, "three watchdog keep-alives")
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: notify.received("STOPPING=1"), 30, "the front's STOPPING=1")
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.skipif(ctypes.util.find_library("seccomp") is None, reason="needs libseccomp2")
def test_front_serves_inside_its_units_syscall_filter(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    with running_service(tmp_path, model="dummy") as service:
        log_path = tmp_path / "front.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.ops.sandbox", "--unit", str(UNIT), "--",
                 sys.executable, "-m", "pagoda.openai_front", "--listen", address,
                 "--target", service.address],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
            )  # fmt: skip
        try:

            def healthy() -> bool:
                assert process.poll() is None, log_path.read_text()
                try:
                    return httpx.get(f"http://{address}/health", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_until(healthy, 60, "the sandboxed front to serve")
            response = httpx.post(
                f"http://{address}/v1/completions",
                json={"prompt": "The sea is", "max_tokens": 4, "stream": True},
                timeout=60,
            )
            assert response.status_code == 200, response.text
            assert response.text.rstrip().endswith("data: [DONE]")
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0, log_path.read_text()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
