"""Two tenants, fair share off and on: `python -m benchmarks.tenants`.

Starts a scheduler with two API keys (tenants `flood` and `probe`) and the dummy worker
(--dummy-step-ms). For each setting of --fair-share: the probe first sends --probes short
requests one after another on an idle server (its baseline time to first token); then the
flood key runs --streams closed-loop streams of --max-new-tokens with `pagoda bench`'s
load generator for --duration-s while the probe sends its short requests one after
another. Reports the probe's TTFT p50/p99 (server side, Timings.first_token_ms) idle and
under the flood, how many it finished, and each tenant's share of the tokens served over
the run (GetServerStats.tenants, each key asking for its own). The load average is printed
with each row: on a shared machine it says how much the figures mean.

The issue's goal for the probe under the flood is a TTFT p99 within twice its idle TTFT
(p50) plus one step; the step is the flood's mean (wall time over the steps the server
counted), and each row prints that goal beside the p99. With two CPUs or more (--pin, the
default there) the worker and the scheduler run on half of them and this process, the
load generator, on the rest: a server's clients are on other machines, and a load
generator sharing the server's cores stalls the worker's and the scheduler's turns in
bursts that make the probe's tail (docs/benchmarks.md, "Two tenants").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import threading
import time

from benchmarks.suite_service import LocalService, resolve_model_dir, split_cpus
from pagoda.client import AsyncClient
from pagoda.client.bench import run_bench
from pagoda.client.bench_config import BenchConfig

FLOOD_KEY, PROBE_KEY = "flood-key-0123456789", "probe-key-0123456789"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def probe_ttfts_ms(address: str, *, until: threading.Event | None, count: int) -> list[float]:
    """TTFTs of short requests sent one after another: `count` of them, or until `until`."""
    ttfts = []
    async with AsyncClient(address, api_key=PROBE_KEY, timeout_s=600) as client:
        while (until is None and len(ttfts) < count) or (until is not None and not until.is_set()):
            completion = await client.complete([7, 8, 9], max_new_tokens=4, ignore_eos=True)
            ttfts.append(completion.timings.first_token_ms)
    return ttfts


async def served_tokens(address: str) -> tuple[dict[str, int], int]:
    """Each tenant's tokens served (each key asks for its own), and the server's steps."""
    served, num_steps = {}, 0
    for key in (FLOOD_KEY, PROBE_KEY):
        async with AsyncClient(address, api_key=key) as client:
            stats = await client.server_stats()
            num_steps = stats.num_steps
            for tenant in stats.tenants:
                served[tenant.tenant] = tenant.num_served_tokens
    return served, num_steps


def ttft_goal_ms(idle_ttft_ms: float, step_ms: float) -> float:
    """Issue 27's bound on the probe's TTFT p99 under the flood: twice its idle TTFT (p50)
    plus one step of the flood."""
    return 2 * idle_ttft_ms + step_ms


def main(argv: list[str] | None = None) -> int:
    cpus = split_cpus()  # (the services', this load generator's), None below two CPUs
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tenants", description=__doc__)
    parser.add_argument("--dummy-step-ms", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=600, help="the flood's closed-loop users")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="of the flood's streams")
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--probes", type=int, default=20, help="idle-server probes")
    parser.add_argument("--max-active-requests", type=int, default=256)
    parser.add_argument(
        "--scheduler-args",
        default="",
        help='more scheduler flags for both settings, as one string (e.g. "--no-late-plan-ahead")',
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=cpus is not None,
        help="the services on half the CPUs, this load generator on the rest (default: on "
        "with two CPUs or more)",
    )
    args = parser.parse_args(argv)
    model_dir = resolve_model_dir("dummy")
    service_cpus = None
    if args.pin:
        if cpus is None:
            parser.error("--pin needs two CPUs or more")
        service_cpus, client_cpus = cpus
        os.sched_setaffinity(0, client_cpus)  # before any thread: they all inherit it
        print(f"services on CPUs {sorted(service_cpus)}, load generator on {sorted(client_cpus)}")
    print(f"dummy worker, {args.dummy_step_ms:g} ms steps; flood: {args.streams} streams of "
          f"{args.max_new_tokens} tokens for {args.duration_s:g} s; probe: 3-token prompts, "
          "4 tokens each")  # fmt: skip
    print(f"{'fair':>5} {'idle p50':>9} {'flood p50':>10} {'flood p99':>10} {'step':>7} "
          f"{'goal':>7} {'probes':>7} {'probe share':>12} {'flood tok/s':>12} "
          f"{'load avg':>9}")  # fmt: skip
    with LocalService(
        worker_model="dummy",
        device="cpu",
        model_dir=model_dir,
        worker_args=("--dummy-step-ms", str(args.dummy_step_ms)),
        cpus=service_cpus,
    ) as service:
        keys = service.run_dir / "api-keys"
        keys.write_text(f"flood:1:{FLOOD_KEY}\nprobe:1:{PROBE_KEY}\n")
        keys.chmod(0o600)
        service.start_worker()
        for fair in (False, True):
            service.use_scheduler(
                ("--api-key-file", str(keys), "--fair-share" if fair else "--no-fair-share",
                 "--max-active-requests", str(args.max_active_requests),
                 "--max-waiting-requests", str(4 * args.streams),
                 "--max-tenant-waiting-requests", str(4 * args.streams),
                 *shlex.split(args.scheduler_args))
            )  # fmt: skip
            idle = asyncio.run(probe_ttfts_ms(service.address, until=None, count=args.probes))
            before, steps_before = asyncio.run(served_tokens(service.address))
            flood_s = time.monotonic()
            done = threading.Event()
            config = BenchConfig.closed_loop(
                args.streams,
                args.duration_s,
                target=service.address,
                api_key=FLOOD_KEY,
                prompt_repeats=(4,),
                max_new_tokens=args.max_new_tokens,
                ignore_eos=True,
            )
            reports = []

            def flood(config=config, done=done, reports=reports) -> None:
                try:
                    reports.append(run_bench(config))
                finally:
                    done.set()

            thread = threading.Thread(target=flood)
            thread.start()
            time.sleep(min(3.0, args.duration_s / 4))  # the flood fills the worker first
            loaded = asyncio.run(probe_ttfts_ms(service.address, until=done, count=0))
            thread.join()
            flood_s = time.monotonic() - flood_s
            after, steps_after = asyncio.run(served_tokens(service.address))
            gained = {name: after[name] - before.get(name, 0) for name in after}
            share = gained.get("probe", 0) / max(1, sum(gained.values()))
            tokens_per_s = reports[0].completion_tokens_per_s if reports else float("nan")
            step_ms = 1000 * flood_s / max(1, steps_after - steps_before)  # the flood's
            idle_ms = percentile(idle, 0.5)
            print(
                f"{'on' if fair else 'off':>5} {idle_ms:>7.0f}ms "
                f"{percentile(loaded, 0.5):>8.0f}ms {percentile(loaded, 0.99):>8.0f}ms "
                f"{step_ms:>5.1f}ms {ttft_goal_ms(idle_ms, step_ms):>5.0f}ms "
                f"{len(loaded):>7} {share:>12.3f} {tokens_per_s:>12.0f} "
                f"{os.getloadavg()[0]:>9.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
