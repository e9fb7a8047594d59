"""How busy the scheduler keeps its worker: `python -m benchmarks.overlap`.

Starts a dummy worker whose every step takes --dummy-step-ms (a simulated forward) and a
scheduler, runs --streams closed-loop streams with `pagoda bench`'s load generator, and
reports the worker's busy fraction (GetServerStats.worker_busy_s over wall time) twice:
over the whole run, and over its steady middle, from --warmup-s after the start to 1 s
before the end, which leaves out the load generator opening its streams and the
cancellation at the end. With it come the generated tokens per second. Each
--scheduler-args setting (e.g. "--no-overlap-steps" and "") is one run on the same worker,
so before and after are measured in one sitting.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import threading
import time

from benchmarks.suite_service import LocalService, resolve_model_dir
from pagoda.client import Client, ServerStats
from pagoda.client.bench import run_bench
from pagoda.client.bench_config import BenchConfig


def server_stats(address: str) -> ServerStats:
    with Client(address, timeout_s=10) as client:
        return client.server_stats()


class SteadyWindow:
    """Samples the worker's busy seconds at two moments of a run, from a thread of its own."""

    def __init__(self, address: str, start_after_s: float, end_after_s: float) -> None:
        self.address = address
        self.moments_s = (start_after_s, end_after_s)
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SteadyWindow:
        self._started_s = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        for moment_s in self.moments_s:
            if self._stop.wait(max(0.0, self._started_s + moment_s - time.monotonic())):
                return
            stats = server_stats(self.address)
            self.samples.append((time.monotonic(), stats.worker_busy_s))

    def busy_fraction(self) -> float | None:
        """None when the run ended before the second sample."""
        if len(self.samples) < 2:
            return None
        (start_s, start_busy_s), (end_s, end_busy_s) = self.samples
        return (end_busy_s - start_busy_s) / (end_s - start_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__)
    parser.add_argument("--dummy-step-ms", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=256, help="closed-loop users")
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--warmup-s", type=float, default=3.0, help="left out of the steady busy fraction"
    )
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
    print(
        f"{'scheduler args':<28} {'busy':>6} {'steady':>6} {'tok/s':>9} {'steps/s':>8} "
        f"{'tok/step':>9}"
    )
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
            config = BenchConfig.closed_loop(
                args.streams,
                args.duration_s,
                target=service.address,
                prompt_repeats=(16,),
                max_new_tokens=args.max_new_tokens,
                ignore_eos=True,
            )
            before, started_s = server_stats(service.address), time.monotonic()
            steady_end_s = args.duration_s - 1.0
            with SteadyWindow(service.address, args.warmup_s, steady_end_s) as window:
                report = run_bench(config)
            steady = window.busy_fraction()
            after, ended_s = server_stats(service.address), time.monotonic()
            elapsed_s = ended_s - started_s
            fraction = (after.worker_busy_s - before.worker_busy_s) / elapsed_s
            num_steps = after.num_steps - before.num_steps
            tokens_per_step = (after.num_generated_tokens - before.num_generated_tokens) / max(
                1, num_steps
            )
            print(
                f"{setting or '(defaults)':<28} {fraction:>6.1%} "
                f"{'-' if steady is None else format(steady, '.1%'):>6} "
                f"{report.completion_tokens_per_s:>9.0f} {num_steps / elapsed_s:>8.1f} "
                f"{tokens_per_step:>9.1f}  TTFT p50 {report.ttft.p50_ms:.0f} ms, "
                f"queue p50 {report.queue.p50_ms:.0f} ms",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
