"""How busy the scheduler keeps its worker: `python -m benchmarks.overlap`.

Starts a dummy worker whose every step takes --dummy-step-ms (a simulated forward) and a
scheduler, runs --streams closed-loop streams with `pagoda bench`'s load generator, and
reports the worker's busy fraction over the run (GetServerStats.worker_busy_s before and
after, over the wall time between) with the generated tokens per second. Each
--scheduler-args setting (e.g. "--no-overlap-steps" and "") is one run on the same worker,
so before and after are measured in one sitting.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import grpc
from pagoda.client.bench import run_bench
from pagoda.client.bench_config import BenchConfig
from pagoda.protos import generation_pb2, generation_pb2_grpc

from benchmarks.suite_service import LocalService, resolve_model_dir


def server_stats(address: str) -> generation_pb2.ServerStats:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return stub.GetServerStats(generation_pb2.ServerStatsRequest(), timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__)
    parser.add_argument("--dummy-step-ms", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=256, help="closed-loop users")
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--scheduler-args",
        action="append",
        help="scheduler flags of one run, as one string (repeatable; default: one run with none)",
    )
    args = parser.parse_args(argv)
    settings = args.scheduler_args or [""]
    model_dir = resolve_model_dir("dummy")
    worker_args = ("--dummy-step-ms", str(args.dummy_step_ms))
    print(f"dummy worker, {args.dummy_step_ms:g} ms steps, {args.streams} streams, "
          f"{args.duration_s:g} s per run")  # fmt: skip
    print(f"{'scheduler args':<28} {'busy':>6} {'tok/s':>9} {'steps/s':>8} {'tok/step':>9}")
    with LocalService(
        worker_model="dummy", device="cpu", model_dir=model_dir, worker_args=worker_args
    ) as service:
        service.start_worker()
        for setting in settings:
            scheduler_args = (
                "--max-waiting-requests",
                str(4 * args.streams),
                *shlex.split(setting),
            )
            service.use_scheduler(scheduler_args)
            config = BenchConfig(
                target=service.address,
                arrival="closed",
                num_users=args.streams,
                num_requests=1_000_000,
                duration_s=args.duration_s,
                prompt_repeats=(16,),
                max_new_tokens=args.max_new_tokens,
                ignore_eos=True,
            )
            before, started_s = server_stats(service.address), time.monotonic()
            report = run_bench(config)
            after, ended_s = server_stats(service.address), time.monotonic()
            elapsed_s = ended_s - started_s
            fraction = (after.worker_busy_s - before.worker_busy_s) / elapsed_s
            num_steps = after.num_steps - before.num_steps
            tokens_per_step = (after.num_generated_tokens - before.num_generated_tokens) / max(
                1, num_steps
            )
            print(
                f"{setting or '(defaults)':<28} {fraction:>6.1%} "
                f"{report.completion_tokens_per_s:>9.0f} {num_steps / elapsed_s:>8.1f} "
                f"{tokens_per_step:>9.1f}  TTFT p50 {report.ttft.p50_ms:.0f} ms, "
                f"queue p50 {report.queue.p50_ms:.0f} ms",
                flush=True,
            )
        service.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
