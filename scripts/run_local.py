"""`make run`: start a worker, a scheduler and the OpenAI-compatible front on this machine,
wait until they serve, stay up.

The worker and the scheduler talk over a private ipc:// socket in a fresh 0700 directory; the
gRPC API listens on --grpc-address (127.0.0.1:50051) and pagoda-openai, its client, on
--openai-address (127.0.0.1:8000; "none" leaves it out). With --replicas N, N workers and
schedulers (each on a free loopback port, the CPUs shared out among the workers) stand
behind pagoda-router on --grpc-address. Ctrl-C stops them all cleanly.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

READY_TIMEOUT_S = 600  # the first start converts the default model (~30 s on 2 cores)


def wait_serving(address: str, processes: list[subprocess.Popen], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in processes):
                return False
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return False


def wait_http_ok(url: str, processes: list[subprocess.Popen], timeout_s: float) -> bool:
    """Poll `url` until it answers 200 (pagoda-openai's /health: its scheduler serves)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            return False
        try:
            with urllib.request.urlopen(url, timeout=1.0) as reply:
                if reply.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    return False


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            process.kill()


def banner(
    grpc_address: str,
    pids: list[str],
    front: subprocess.Popen | None,
    openai_url: str | None,
) -> str:
    lines = [f"\npagoda: serving on {grpc_address} ({', '.join(pids)})"]
    if front is not None:
        lines.append(f"  OpenAI-compatible API: {openai_url} (pagoda-openai pid {front.pid})")
    lines += [
        "  in another terminal:",
        '    .venv/bin/pagoda generate "Write a haiku about the sea"',
        "    .venv/bin/pagoda chat",
        "    .venv/bin/pagoda stats",
    ]
    if front is not None:
        lines += [
            f"    curl -s {openai_url}/chat/completions -H 'Content-Type: application/json' \\",
            """      -d '{"messages": [{"role": "user", "content": "Write a haiku about the sea"}]}'""",
        ]
    lines.append("  Ctrl-C stops them all.\n")
    return "\n".join(lines)


def free_loopback_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def start_replica(
    args: argparse.Namespace,
    runtime_dir: str,
    index: int,
    grpc_address: str,
    scheduler_model: str,
    scheduler_flags: list[str],
    worker_env: dict[str, str] | None,
) -> tuple[subprocess.Popen, subprocess.Popen]:
    """A worker and its scheduler on grpc_address, linked by their own ipc:// socket."""
    endpoint = f"ipc://{runtime_dir}/worker-{index}.sock"
    worker = subprocess.Popen(
        [
            sys.executable, "-m", "pagoda.gpu_worker",
            "--zmq-endpoint", endpoint,
            "--model", args.model,
            "--device", args.device,
        ],
        env=worker_env,
    )  # fmt: skip
    scheduler = subprocess.Popen(
        [
            sys.executable, "-m", "pagoda.scheduler_svc",
            "--grpc-address", grpc_address,
            "--zmq-endpoint", endpoint,
            "--model", scheduler_model,
            *scheduler_flags,
        ]
    )  # fmt: skip
    return worker, scheduler


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model",
        default="default",
        help="worker model spec (default, dummy, a directory, a .gguf)",
    )
    parser.add_argument("--grpc-address", default="127.0.0.1:50051")
    parser.add_argument("--device", default="auto", help="worker device: auto, cpu or cuda")
    parser.add_argument(
        "--openai-address",
        default="127.0.0.1:8000",
        help='HOST:PORT of the OpenAI-compatible front (pagoda-openai); "none": do not start it',
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="start N workers and schedulers behind pagoda-router on --grpc-address",
    )
    args, scheduler_flags = parser.parse_known_args()
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")

    scheduler_model = "default" if args.model == "dummy" else args.model
    # The worker converts the default model on first use; the scheduler reads the result.
    resolve = subprocess.run(
        [sys.executable, "-m", "pagoda.gpu_worker.model_loader", scheduler_model]
    )
    if resolve.returncode != 0:
        return resolve.returncode
    runtime_dir = tempfile.mkdtemp(prefix="pagoda-run-")  # the workers' sockets
    os.chmod(runtime_dir, 0o700)
    worker_env = None
    if args.replicas > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Each worker's torch would take every core; they share them out instead.
        threads = max(1, len(os.sched_getaffinity(0)) // args.replicas)
        worker_env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    addresses = (
        [args.grpc_address]
        if args.replicas == 1
        else [free_loopback_address() for _ in range(args.replicas)]
    )
    processes = []
    pids = []
    for index, address in enumerate(addresses):
        worker, scheduler = start_replica(
            args, runtime_dir, index, address, scheduler_model, scheduler_flags, worker_env
        )
        processes += [worker, scheduler]
        pids.append(f"worker pid {worker.pid}, scheduler pid {scheduler.pid}")
    if args.replicas > 1:
        router = subprocess.Popen(
            [
                sys.executable, "-m", "pagoda.router",
                "--listen", args.grpc_address,
                "--backends", ",".join(addresses),
                "--log-level", "WARNING",
            ]
        )  # fmt: skip
        processes.append(router)
        pids.append(f"pagoda-router pid {router.pid} in front of {', '.join(addresses)}")
    # Installed explicitly: a shell that starts us in the background ignores SIGINT.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    try:
        ready = all(wait_serving(a, processes, READY_TIMEOUT_S) for a in addresses)
        if not ready or not wait_serving(args.grpc_address, processes, READY_TIMEOUT_S):
            print("pagoda: the service did not become ready; see the logs above", file=sys.stderr)
            stop(processes)
            return 1
        front = openai_url = None
        if args.openai_address != "none":
            front = subprocess.Popen(
                [
                    sys.executable, "-m", "pagoda.openai_front",
                    "--listen", args.openai_address,
                    "--target", args.grpc_address,
                    "--log-level", "WARNING",
                ]
            )  # fmt: skip
            processes.append(front)
            openai_url = f"http://{args.openai_address}/v1"
            if not wait_http_ok(f"http://{args.openai_address}/health", processes, 60):
                print("pagoda: the OpenAI front did not become ready", file=sys.stderr)
                stop(processes)
                return 1
        print(banner(args.grpc_address, pids, front, openai_url), flush=True)
        while all(p.poll() is None for p in processes):
            time.sleep(0.5)
        print("pagoda: a process exited; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\npagoda: stopping", file=sys.stderr)
        return 0
    finally:
        stop(processes)
        shutil.rmtree(runtime_dir, ignore_errors=True)  # a socket a killed worker left


if __name__ == "__main__":
    sys.exit(main())
