"""The service `make bench` measures: a worker and a scheduler it starts itself, or BENCH_TARGET.

The local service binds gRPC to a free loopback port and talks to its worker over an ipc://
socket in a fresh 0700 directory. The worker is started once; each knob setting restarts only
the scheduler (the worker says hello again to the new one by itself). Readiness is grpc
health SERVING, polled; every process is stopped by its PID with SIGTERM, on errors and
Ctrl-C too. Children run in their own session so a terminal's Ctrl-C reaches only the suite,
which then stops them in order. Given `cpus`, its processes run on those CPUs only (a load
generator on the same machine then keeps to the others: see split_cpus).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagoda.client import Client, DeadlineExceededError

REPO_ROOT = Path(__file__).resolve().parents[1]
# The first start converts the default model (about 30 s on 2 cores) before loading it.
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 40.0
POLL_INTERVAL_S = 0.2


def split_cpus() -> tuple[frozenset[int], frozenset[int]] | None:
    """This process's CPUs in two disjoint sets, the service's and its load generator's
    (the last half, at least one), or None with fewer than two. On a machine that serves,
    clients are elsewhere; one that also runs the load generator gives the service CPUs
    of its own, or the generator's bursts stall the scheduler and the worker and measure
    this machine's crowding rather than the service."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    num_service = len(cpus) - len(cpus) // 2
    return frozenset(cpus[:num_service]), frozenset(cpus[num_service:])


class ServiceError(RuntimeError):
    """A process of the service failed to start or died; the message ends with its log tail."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_serving(
    address: str, processes: list[subprocess.Popen], timeout_s: float = READY_TIMEOUT_S
) -> float:
    """Poll grpc health until SERVING; the seconds it took. Raises ServiceError if a process
    exits or the timeout passes."""
    start = time.monotonic()
    with Client(address) as client:
        while time.monotonic() - start < timeout_s:
            for process in processes:
                if process.poll() is not None:
                    raise ServiceError(f"{process.args[2]} exited with {process.returncode}")
            try:
                client.wait_ready(timeout_s=POLL_INTERVAL_S)
                return time.monotonic() - start
            except DeadlineExceededError:
                pass
    raise ServiceError(f"{address} did not report SERVING within {timeout_s:.0f} s")


def stop_process(process: subprocess.Popen | None) -> None:
    """SIGTERM by PID, wait for the drain, SIGKILL only if it does not exit."""
    if process is None or process.poll() is not None:
        return
    os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()


def resolve_model_dir(model: str) -> str:
    """The local directory of `model` (converting the default GGUF on first use), resolved in a
    child process as the service does, so this process imports torch only for the peers."""
    spec = "default" if model == "dummy" else model
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.gpu_worker.model_loader", spec],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    if result.returncode != 0 or not result.stdout.strip():
        raise ServiceError(f"cannot resolve model {spec!r} (see the message above)")
    return result.stdout.strip().splitlines()[-1]


class LocalService:
    """A worker and a restartable scheduler on this machine; use as a context manager (its
    exit stops both and removes the run directory with their logs)."""

    def __init__(
        self,
        *,
        worker_model: str,
        device: str,
        model_dir: str,
        worker_args: tuple[str, ...] = (),
        cpus: frozenset[int] | None = None,
    ) -> None:
        """`cpus`: the CPUs the worker and the scheduler run on (None: any)."""
        self.worker_model = worker_model
        self.device = device
        self.worker_args = worker_args  # more worker flags, e.g. --dummy-step-ms 10
        self.cpus = cpus
        # The scheduler reads the tokenizer straight from the resolved directory.
        self.model_dir = model_dir
        self.run_dir = Path(tempfile.mkdtemp(prefix="pagoda-bench-"))
        os.chmod(self.run_dir, 0o700)
        self.endpoint = f"ipc://{self.run_dir}/worker.sock"
        self.address: str | None = None
        self.scheduler_args: tuple[str, ...] | None = None
        self.worker: subprocess.Popen | None = None
        self.scheduler: subprocess.Popen | None = None
        self._num_logs = 0

    def __enter__(self) -> LocalService:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
        self.cleanup()

    def start_worker(self) -> None:
        argv = [sys.executable, "-m", "pagoda.gpu_worker", "--zmq-endpoint", self.endpoint,
                "--model", self.worker_model, "--device", self.device, *self.worker_args]  # fmt: skip
        self.worker = self._spawn(argv, "worker")

    def use_scheduler(self, scheduler_args: tuple[str, ...]) -> float | None:
        """Make sure a scheduler with exactly these flags serves; restart it when they differ.

        Returns the seconds until it served, or None when the running one already fit.
        """
        if self.scheduler_args == scheduler_args and self.scheduler.poll() is None:
            return None
        stop_process(self.scheduler)
        # A fresh port each time: the old listener may linger in TIME_WAIT.
        self.address = f"127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "pagoda.scheduler_svc", "--grpc-address", self.address,
                "--zmq-endpoint", self.endpoint, "--model", self.model_dir,
                "--status-interval-s", "3600", *scheduler_args]  # fmt: skip
        self.scheduler = self._spawn(argv, "scheduler")
        self.scheduler_args = scheduler_args
        try:
            return wait_serving(self.address, [self.worker, self.scheduler])
        except ServiceError as exc:
            raise ServiceError(f"{exc}\n{self.log_tails()}") from None

    def stop(self) -> None:
        stop_process(self.scheduler)
        stop_process(self.worker)
        self.scheduler = self.worker = None

    def cleanup(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def log_tails(self, num_chars: int = 3000) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-num_chars:]}"
            for path in sorted(self.run_dir.glob("*.log"))
        )

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        self._num_logs += 1
        log_path = self.run_dir / f"{self._num_logs:02d}-{name}.log"
        if self.cpus is not None:  # pinned before it starts a thread, then the program
            pin = f"import os, sys; os.sched_setaffinity(0, {sorted(self.cpus)}); "
            argv = [sys.executable, "-c", pin + "os.execv(sys.executable, sys.argv[1:])", *argv]
        with open(log_path, "w") as log:
            return subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                start_new_session=True,
            )
