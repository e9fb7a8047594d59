"""`make run`: start a worker and a scheduler on this machine, wait until they serve, stay up.

The two talk over a private ipc:// socket in a fresh 0700 directory; the gRPC API
listens on --grpc-address (127.0.0.1:50051). Ctrl-C stops both cleanly.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

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


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            process.kill()


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
    args, scheduler_flags = parser.parse_known_args()

    runtime_dir = tempfile.mkdtemp(prefix="pagoda-run-")
    os.chmod(runtime_dir, 0o700)
    endpoint = f"ipc://{runtime_dir}/worker.sock"
    scheduler_model = "default" if args.model == "dummy" else args.model
    # The worker converts the default model on first use; the scheduler reads the result.
    resolve = subprocess.run(
        [sys.executable, "-m", "pagoda.gpu_worker.model_loader", scheduler_model]
    )
    if resolve.returncode != 0:
        return resolve.returncode
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagoda.gpu_worker",
            "--zmq-endpoint",
            endpoint,
            "--model",
            args.model,
            "--device",
            args.device,
        ]
    )
    scheduler = subprocess.Popen(
        [
            sys.executable, "-m", "pagoda.scheduler_svc",
            "--grpc-address", args.grpc_address,
            "--zmq-endpoint", endpoint,
            "--model", scheduler_model,
            *scheduler_flags,
        ]
    )  # fmt: skip
    processes = [worker, scheduler]
    # Installed explicitly: a shell that starts us in the background ignores SIGINT.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    try:
        if not wait_serving(args.grpc_address, processes, READY_TIMEOUT_S):
            print("pagoda: the service did not become ready; see the logs above", file=sys.stderr)
            stop(processes)
            return 1
        print(
            f"\npagoda: serving on {args.grpc_address} (worker pid {worker.pid}, scheduler pid {scheduler.pid})\n"
            "  in another terminal:\n"
            '    .venv/bin/pagoda generate "Write a haiku about the sea"\n'
            "    .venv/bin/pagoda chat\n"
            "    .venv/bin/pagoda stats\n"
            "  Ctrl-C stops both.\n",
            flush=True,
        )
        while all(p.poll() is None for p in processes):
            time.sleep(0.5)
        print("pagoda: a process exited; stopping the other", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\npagoda: stopping", file=sys.stderr)
        return 0
    finally:
        stop(processes)
        try:
            os.rmdir(runtime_dir)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
