"""Real processes on loopback and ipc://: a worker and a scheduler, ready when health says so."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.protos import generation_pb2, generation_pb2_grpc

READY_TIMEOUT_S = 120
REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Service:
    address: str
    endpoint: str
    worker: subprocess.Popen | None
    scheduler: subprocess.Popen
    log_dir: Path
    worker_args: list[str]

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stub(self, channel: grpc.Channel) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(channel)

    def stats(self) -> generation_pb2.ServerStats:
        with self.channel() as channel:
            return self.stub(channel).GetServerStats(
                generation_pb2.ServerStatsRequest(), timeout=10
            )

    def start_worker(self) -> subprocess.Popen:
        self.worker = _spawn(
            [
                sys.executable,
                "-m",
                "pagoda.gpu_worker",
                "--zmq-endpoint",
                self.endpoint,
                *self.worker_args,
            ],
            self.log_dir / f"worker-{time.monotonic_ns()}.log",
        )
        return self.worker

    def replace_worker(self, timeout_s: float = 120, stop_signal=signal.SIGKILL) -> None:
        """Stop the worker with `stop_signal`, start a new one, return once the scheduler
        has attached it (a new incarnation). Blocking: async tests call it through
        asyncio.to_thread."""
        old = self.stats().worker_incarnation_id
        self.worker.send_signal(stop_signal)
        self.worker.wait()
        self.start_worker()
        wait_until(
            lambda: (s := self.stats()).worker_connected and s.worker_incarnation_id != old,
            timeout_s,
            "a new worker incarnation",
        )

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(self.log_dir.glob("*.log"))
        )


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    """Poll `predicate` until it returns something truthy; fail with `what` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def wait_serving(
    address: str, processes: list[subprocess.Popen], timeout_s: float = READY_TIMEOUT_S
) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            for process in processes:
                if process.poll() is not None:
                    raise AssertionError(f"{process.args[2]} exited with {process.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        wait_until(serving, timeout_s, f"{address} to report SERVING")


def stop_process(process: subprocess.Popen | None, timeout_s: float = 30) -> int | None:
    if process is None or process.poll() is not None:
        return None if process is None else process.returncode
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


@contextmanager
def running_service(
    tmp_path: Path,
    *,
    model: str,
    worker_args: list[str] = (),
    scheduler_args: list[str] = (),
    plaintext_health: bool = True,
) -> Iterator[Service]:
    """Start worker + scheduler for `model`; yields once health says SERVING (polled over
    plaintext; a TLS test passes plaintext_health=False and polls itself); stops both."""
    run_dir = (
        Path(os.environ.get("PAGODA_TEST_RUN_DIR", "/tmp"))
        / f"pagoda-e2e-{os.getpid()}-{time.monotonic_ns()}"
    )
    run_dir.mkdir(mode=0o700, parents=True)
    endpoint = f"ipc://{run_dir}/worker.sock"
    address = f"127.0.0.1:{free_port()}"
    tokenizer = "default" if model == "dummy" else model
    service = Service(
        address=address,
        endpoint=endpoint,
        worker=None,
        scheduler=_spawn(
            [
                sys.executable,
                "-m",
                "pagoda.scheduler_svc",
                "--grpc-address",
                address,
                "--zmq-endpoint",
                endpoint,
                "--model",
                tokenizer,
                "--status-interval-s",
                "3600",
                *scheduler_args,
            ],
            tmp_path / "scheduler.log",
        ),  # fmt: skip
        log_dir=tmp_path,
        # --device cpu: exact-parity tests compare with transformers' float32 CPU forward,
        # which a GPU host's bfloat16 worker would not match (a test may still override it).
        worker_args=["--model", model, "--device", "cpu", *worker_args],
    )
    service.start_worker()
    try:
        if plaintext_health:
            wait_serving(address, [service.scheduler, service.worker])
        yield service
    except BaseException:
        print(service.logs())
        raise
    finally:
        stop_process(service.scheduler)
        stop_process(service.worker)
        for leftover in run_dir.glob("*"):
            leftover.unlink()
        run_dir.rmdir()


@pytest.fixture(scope="session")
def default_reference(default_model_dir):
    """transformers' own greedy generate() on the default model, for parity checks."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            output = model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tokenizer.pad_token_id,
            )
        return output[0, len(prompt_ids) :].tolist()

    generate.tokenizer = tokenizer
    return generate
