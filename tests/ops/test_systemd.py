"""The systemd units verify, and both services speak sd_notify through $NOTIFY_SOCKET."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import free_port, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
UNITS = REPO_ROOT / "deploy" / "systemd"
VENV_BIN = Path(sys.executable).parent


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="needs Debian's systemd package"
)
def test_units_pass_systemd_analyze_verify(tmp_path):
    # verify also checks that ExecStart exists: point it at this checkout's console scripts.
    units = []
    for unit in sorted(UNITS.glob("*.service")):
        text = unit.read_text().replace("/opt/pagoda/.venv/bin/", f"{VENV_BIN}/")
        (tmp_path / unit.name).write_text(text)
        units.append(str(tmp_path / unit.name))
    result = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_units_are_notify_watchdog_sandboxed_and_unprivileged():
    for unit in ("pagoda-scheduler.service", "pagoda-worker.service"):
        text = (UNITS / unit).read_text()
        for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "User=pagoda",
                     "RuntimeDirectory=pagoda", "RuntimeDirectoryMode=0700", "ProtectSystem=strict",
                     "PrivateTmp=yes", "NoNewPrivileges=yes"):  # fmt: skip
            assert line in text, f"{unit} lacks {line}"


class NotifySocket:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []

    def received(self, line: str) -> bool:
        try:
            self.messages.extend(self.sock.recv(4096).decode().splitlines())
        except TimeoutError:
            pass
        return line in self.messages

    def count(self, line: str) -> int:
        self.received(line)
        return self.messages.count(line)


def test_services_notify_ready_watchdog_and_stopping(tmp_path):
    scheduler_notify = NotifySocket(tmp_path / "scheduler.notify")
    worker_notify = NotifySocket(tmp_path / "worker.notify")
    endpoint = f"ipc://{tmp_path}/w.sock"
    address = f"127.0.0.1:{free_port()}"
    scheduler = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagoda.scheduler_svc",
            "--grpc-address",
            address,
            "--zmq-endpoint",
            endpoint,
        ],
        env=dict(os.environ, NOTIFY_SOCKET=str(scheduler_notify.path), WATCHDOG_USEC="2000000"),
        cwd=REPO_ROOT,
    )
    worker = subprocess.Popen(
        [sys.executable, "-m", "pagoda.gpu_worker", "--model", "dummy", "--zmq-endpoint", endpoint],
        env=dict(os.environ, NOTIFY_SOCKET=str(worker_notify.path), WATCHDOG_USEC="2000000"),
        cwd=REPO_ROOT,
    )
    try:
        wait_until(lambda: scheduler_notify.received("READY=1"), 60, "the scheduler's READY=1")
        wait_until(lambda: worker_notify.received("READY=1"), 60, "the worker's READY=1")
        # Keep-alives keep coming while the loops turn (a stuck loop sends none after the
        # first), at half of WATCHDOG_USEC: several within the wait.
        for notify in (scheduler_notify, worker_notify):
            notify.messages.clear()
            wait_until(
                lambda n=notify: n.count("WATCHDOG=1") >= 3,
                30,
                "three watchdog keep-alives",
            )
        scheduler.send_signal(signal.SIGTERM)
        wait_until(
            lambda: scheduler_notify.received("STOPPING=1"), 30, "the scheduler's STOPPING=1"
        )
        assert scheduler.wait(timeout=30) == 0
    finally:
        for process in (scheduler, worker):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=30)
