"""Tokens per second with 1 and 2 workers behind one scheduler: `python -m
benchmarks.data_parallel`.

For each --workers count N, starts a scheduler with --max-workers N and N workers on this
machine (the dummy worker with --dummy-step-ms, or a real model on the CPU with
OMP_NUM_THREADS=--threads-per-worker each), runs --streams closed-loop streams with
`pagoda bench`'s load generator for --duration-s, and reports generated tokens per second,
steps per second and each worker's share of the steps (GetServerStats.workers). The load
average is printed with each row: on a shared machine it says how much the figures mean.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

from benchmarks.overlap import server_stats
from benchmarks.suite_service import LocalService, resolve_model_dir, stop_process
from pagoda.client.bench import run_bench
from pagoda.client.bench_config import BenchConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_parallel", description=__doc__)
    parser.add_argument("--model", default="dummy", help="dummy, default or a directory")
    parser.add_argument("--workers", default="1,2", help="worker counts to run, in order")
    parser.add_argument("--dummy-step-ms", type=float, default=10.0)
    parser.add_argument("--threads-per-worker", type=int, default=1, help="CPU models only")
    parser.add_argument("--streams", type=int, default=128, help="closed-loop users")
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--prompt-repeats", type=int, default=16, help="prompt length, ~tokens")
    parser.add_argument("--scheduler-args", default="", help="more scheduler flags, one string")
    parser.add_argument("--worker-args", default="", help="more worker flags, one string")
    args = parser.parse_args(argv)
    dummy = args.model == "dummy"
    worker_args = tuple(shlex.split(args.worker_args))
    if dummy:
        worker_args += ("--dummy-step-ms", str(args.dummy_step_ms))
    else:
        os.environ["OMP_NUM_THREADS"] = str(args.threads_per_worker)  # the workers inherit it
    model_dir = resolve_model_dir(args.model)
    print(f"model {args.model}, {args.streams} streams, {args.duration_s:g} s per run, "
          f"worker args {' '.join(worker_args) or '-'}")  # fmt: skip
    print(f"{'workers':>7} {'tok/s':>9} {'steps/s':>8} {'steps per worker':>18} {'load avg':>9}")
    for num_workers in (int(n) for n in args.workers.split(",")):
        with LocalService(
            worker_model=args.model, device="cpu", model_dir=model_dir, worker_args=worker_args
        ) as service:
            service.start_worker()
            service.use_scheduler(
                ("--max-workers", str(num_workers), "--max-waiting-requests",
                 str(4 * args.streams), *shlex.split(args.scheduler_args))
            )  # fmt: skip
            extra = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "pagoda.gpu_worker",
                        "--zmq-endpoint",
                        service.endpoint,
                        "--model",
                        args.model,
                        "--device",
                        "cpu",
                        *worker_args,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )  # fmt: skip
                for _ in range(num_workers - 1)
            ]
            try:
                deadline = time.monotonic() + 300
                while len(server_stats(service.address).workers) < num_workers:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{num_workers} workers never attached")
                    time.sleep(0.2)
                config = BenchConfig.closed_loop(
                    args.streams,
                    args.duration_s,
                    target=service.address,
                    prompt_repeats=(args.prompt_repeats,),
                    max_new_tokens=args.max_new_tokens,
                    ignore_eos=True,
                )
                before, started_s = server_stats(service.address), time.monotonic()
                report = run_bench(config)
                after, ended_s = server_stats(service.address), time.monotonic()
                elapsed_s = ended_s - started_s
                steps_before = {w.incarnation_id: w.num_steps for w in before.workers}
                per_worker = [
                    w.num_steps - steps_before.get(w.incarnation_id, 0) for w in after.workers
                ]
                print(
                    f"{num_workers:>7} {report.completion_tokens_per_s:>9.0f} "
                    f"{sum(per_worker) / elapsed_s:>8.1f} "
                    f"{' / '.join(str(n) for n in per_worker):>18} "
                    f"{os.getloadavg()[0]:>9.2f}",
                    flush=True,
                )
            finally:
                for process in extra:
                    stop_process(process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
