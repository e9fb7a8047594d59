"""The systemd units verify, carry their sandbox, score low on `systemd-analyze security`,
and both services speak sd_notify through $NOTIFY_SOCKET and serve inside that sandbox."""

from __future__ import annotations

import ctypes.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tests.e2e.conftest import free_port, wait_serving, wait_until
from tests.ops.sandbox import unit_settings

REPO_ROOT = Path(__file__).resolve().parents[2]
UNITS = REPO_ROOT / "deploy" / "systemd"
VENV_BIN = Path(sys.executable).parent
CPU_ONLY_DROP_IN = UNITS / "pagoda-worker-cpu-only.conf"
# systemd-analyze security's overall exposure (0 = locked down, 10 = none): measured 1.5 for
# the scheduler, 1.6 for the worker, 1.4 with the CPU-only drop-in and 1.5 for pagoda-openai
# (systemd 252), down from 5.8 and 6.4. The bound leaves room for a justified relaxation, not
# for a lost block.
MAX_EXPOSURE = 2.0
needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="needs Debian's systemd package"
)


def local_units(directory: Path) -> list[Path]:
    """The units with ExecStart on this checkout's console scripts (verify checks it exists)."""
    units = []
    for unit in sorted(UNITS.glob("*.service")):
        text = unit.read_text().replace("/opt/pagoda/.venv/bin/", f"{VENV_BIN}/")
        (directory / unit.name).write_text(text)
        units.append(directory / unit.name)
    return units


@needs_systemd_analyze
def test_units_pass_systemd_analyze_verify(tmp_path):
    units = [str(unit) for unit in local_units(tmp_path)]
    result = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def exposure(unit_name: str, root: Path) -> float:
    """The overall exposure of root/etc/systemd/system/unit_name, drop-ins included."""
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", f"--root={root}", "--no-pager",
         unit_name],
        capture_output=True,
        text=True,
    )  # fmt: skip
    if "unrecognized option" in result.stderr:  # --offline came with systemd 250
        pytest.skip(f"this systemd-analyze cannot score unit files: {result.stderr.strip()}")
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    return float(match.group(1))


@needs_systemd_analyze
@pytest.mark.parametrize("drop_in", [None, CPU_ONLY_DROP_IN], ids=["as-shipped", "cpu-only"])
def test_exposure_stays_low(tmp_path, drop_in):
    system = tmp_path / "etc/systemd/system"
    system.mkdir(parents=True)
    units = local_units(system)
    if drop_in is not None:
        (system / "pagoda-worker.service.d").mkdir()
        shutil.copy(drop_in, system / "pagoda-worker.service.d" / "cpu-only.conf")
        units = [system / "pagoda-worker.service"]
    for unit in units:
        score = exposure(unit.name, tmp_path)
        assert score <= MAX_EXPOSURE, f"{unit.name}{' + ' + drop_in.name if drop_in else ''}"


# Each (directive, value) must be the unit's last word on it; "" means "set, any value".
HARDENING = {
    "CapabilityBoundingSet": "", "AmbientCapabilities": "", "NoNewPrivileges": "yes",
    "UMask": "0077", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
    "PrivateIPC": "yes", "RemoveIPC": "yes", "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes", "ProtectKernelLogs": "yes", "ProtectControlGroups": "yes",
    "ProtectClock": "yes", "ProtectHostname": "yes", "ProtectProc": "invisible",
    "RestrictSUIDSGID": "yes", "RestrictRealtime": "yes", "RestrictNamespaces": "yes",
    "LockPersonality": "yes", "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    "SystemCallArchitectures": "native", "RestartPreventExitStatus": "2",
}  # fmt: skip


def last(settings: dict[str, list[str]], key: str) -> str | None:
    values = settings.get(key)
    return values[-1] if values else None


@pytest.mark.parametrize(
    "unit",
    [
        "pagoda-scheduler.service",
        "pagoda-worker.service",
        "pagoda-openai.service",
        "pagoda-router.service",
    ],
)
def test_units_carry_the_sandbox(unit):
    text = (UNITS / unit).read_text()
    settings = unit_settings([UNITS / unit])
    for key, value in HARDENING.items():
        if value == "":  # an empty assignment: no capabilities at all
            assert re.search(rf"^{key}=$", text, re.M), f"{unit} lacks an empty {key}="
        else:
            assert last(settings, key) == value, f"{unit}: {key}={last(settings, key)}"
    assert settings["SystemCallFilter"][0] == "@system-service"
    assert "@privileged" in settings["SystemCallFilter"][1].removeprefix("~").split()
    # libzmq aborts when pthread_setschedparam (in @resources) is refused as a thread starts.
    assert not any("@resources" in line for line in settings["SystemCallFilter"][1:])
    assert last(settings, "MemoryMax") and last(settings, "MemoryHigh")
    assert last(settings, "TasksMax")
    assert int(last(settings, "LimitNOFILE") or 0) >= 65536  # not systemd's 1024 (review N2)
    # Secrets come as systemd credentials, looked up by name so that a missing one is skipped.
    for credential in settings.get("LoadCredential", []):
        credential_id, source = credential.split(":")
        assert not source.startswith("/"), f"{unit}: {credential} would fail when absent"


def test_scheduler_is_kept_from_devices_and_kernel_files():
    settings = unit_settings([UNITS / "pagoda-scheduler.service"])
    assert last(settings, "PrivateDevices") == "yes"
    assert last(settings, "ProcSubset") == "pid"
    assert {c.split(":")[0] for c in settings["LoadCredential"]} == {
        "api-key", "tls-key", "curve-secret-key"
    }  # fmt: skip


def test_worker_reaches_only_nvidia_devices_and_localhost():
    settings = unit_settings([UNITS / "pagoda-worker.service"])
    assert last(settings, "DevicePolicy") == "closed"
    assert settings["DeviceAllow"] == ["char-nvidia* rw"]
    assert last(settings, "PrivateDevices") is None  # it would hide /dev/nvidia*
    assert (last(settings, "IPAddressDeny"), last(settings, "IPAddressAllow")) == (
        "any",
        "localhost",
    )
    cpu_only = unit_settings([UNITS / "pagoda-worker.service", CPU_ONLY_DROP_IN])
    assert cpu_only.get("DeviceAllow") == []
    assert last(cpu_only, "PrivateDevices") == "yes"
    # /proc stays whole: fbgemm reads /proc/cpuinfo (the drop-in says why).
    assert last(cpu_only, "ProcSubset") in (None, "all")


def test_config_examples_read_secrets_from_the_credentials_directory():
    toml = (UNITS / "pagoda.toml").read_text()
    env = (UNITS / "pagoda.env").read_text()
    scheduler = "/run/credentials/pagoda-scheduler.service/"
    worker = "/run/credentials/pagoda-worker.service/"
    for key, credential_id in [
        ("api_key_file", "api-key"),
        ("tls_key", "tls-key"),
        ("zmq_curve_secret_key", "curve-secret-key"),
    ]:
        assert f'# {key} = "{scheduler}{credential_id}"' in toml
    assert f"# PAGODA_WORKER_ZMQ_CURVE_SECRET_KEY={worker}curve-secret-key" in env


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


def sandboxed(unit: str, *drop_ins: Path) -> list[str]:
    """argv prefix that runs a command inside `unit`'s rebuildable sandbox (tests/ops/sandbox.py)."""
    argv = [sys.executable, "-m", "tests.ops.sandbox", "--unit", str(UNITS / unit)]
    for drop_in in drop_ins:
        argv += ["--drop-in", str(drop_in)]
    return [*argv, "--"]


def spawn(argv: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)


@pytest.mark.slow
@needs_systemd_analyze
@pytest.mark.skipif(ctypes.util.find_library("seccomp") is None, reason="needs libseccomp2")
@pytest.mark.parametrize("worker_drop_ins", [(), (CPU_ONLY_DROP_IN,)], ids=["gpu-unit", "cpu-only"])
def test_services_generate_inside_the_units_syscall_filter(tmp_path, worker_drop_ins):
    """The real default model, torch and all, under each unit's SystemCallFilter (refusals
    answered with its SystemCallErrorNumber), RestrictAddressFamilies, NoNewPrivileges and
    (as root) its private /proc: a greedy request completes and SIGTERM still drains."""
    from pagoda.protos import generation_pb2, generation_pb2_grpc

    endpoint = f"ipc://{tmp_path}/w.sock"
    address = f"127.0.0.1:{free_port()}"
    scheduler = spawn(
        [*sandboxed("pagoda-scheduler.service"), sys.executable, "-m", "pagoda.scheduler_svc",
         "--grpc-address", address, "--zmq-endpoint", endpoint, "--model", "default"],
        tmp_path / "scheduler.log",
    )  # fmt: skip
    worker = spawn(
        [*sandboxed("pagoda-worker.service", *worker_drop_ins), sys.executable, "-m",
         "pagoda.gpu_worker", "--model", "default", "--device", "cpu", "--zmq-endpoint",
         endpoint],
        tmp_path / "worker.log",
    )  # fmt: skip
    try:
        wait_serving(address, [scheduler, worker])
        with grpc.insecure_channel(address) as channel:
            responses = list(
                generation_pb2_grpc.GenerationStub(channel).Generate(
                    generation_pb2.GenerateRequest(
                        prompt="The sea is",
                        stopping=generation_pb2.StoppingCriteria(max_new_tokens=8, ignore_eos=True),
                    ),
                    timeout=120,
                )
            )
        assert sum(len(r.token_ids) for r in responses) == 8
        assert responses[-1].finish_reason == generation_pb2.LENGTH
        scheduler.send_signal(signal.SIGTERM)
        assert scheduler.wait(timeout=60) == 0
    except BaseException:
        for log in sorted(tmp_path.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text()[-4000:]}")
        raise
    finally:
        for process in (scheduler, worker):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=30)
