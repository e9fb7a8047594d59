"""The step budget (--target-step-ms) replayed on a simulated worker: ITL and throughput of a
workload when each step costs a + b * prompt tokens + c * decode sequences milliseconds.

    .venv/bin/python -m benchmarks.step_budget [--costs int8|fp32|A,B,C] [--noise 0.1]
                                 [--outliers 0.005] [--targets 0,250,500,750,1000]

The scheduler core runs against the in-process fake worker on a simulated clock: the
clock moves by each step's simulated cost, one step at a time (no overlap, no scheduler or
transport time), and the fake worker reports that cost as its forward_ms, so the step
budget learns it as it learns a real worker's. Nothing here depends on the machine's load:
it isolates what the budget does to the step shapes from the noise of a shared CPU. The
cost presets are issue 15's measurements of the default model on 2 cores (int8: decode
batch 1 18.8 ms, 64 105 ms, a 512-token prefill 341 ms; fp32: 64.8, 203 and 763 ms),
fitted to the linear model. Each step's cost is multiplied by a log-normal noise of
--noise, and a share --outliers of the steps takes 4x (a GC pause, a neighbour on the
cores).

Workloads as in benchmarks/scenarios.py: burst-512-mix (64 requests at once, prompts
cycling 512/8/8/8 tokens, 32 new each), burst-short (64 x 32 tokens, 64 new) and
trickle-short (32 x 32 tokens, one every 250 ms, 32 new).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random

from pagoda.scheduler_svc.core import (
    Scheduler,
    SchedulerConfig,
    ValidRequest,
    ValidStopping,
    WorkerGeometry,
)
from pagoda.scheduler_svc.testing import FakeWorker

from benchmarks.scheduler_core import SAMPLING  # greedy, no penalties

COST_PRESETS = {"int8": (18.0, 0.63, 1.4), "fp32": (60.0, 1.37, 2.2)}


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    name: str
    num_requests: int
    prompt_tokens: tuple[int, ...]  # cycled over the requests
    max_new_tokens: int
    interval_ms: float = 0.0  # 0: a burst


WORKLOADS = (
    Workload("burst-512-mix", 64, (512, 8, 8, 8), 32),
    Workload("burst-short", 64, (32,), 64),
    Workload("trickle-short", 32, (32,), 32, interval_ms=250.0),
)


@dataclasses.dataclass(slots=True)
class Outcome:
    tokens_per_s: float
    itl_ms: list[float]
    ttft_ms: list[float]


def run(
    workload: Workload,
    target_step_ms: float,
    costs: tuple[float, float, float],
    noise: float,
    outlier_rate: float,
    seed: int,
) -> Outcome:
    geometry = WorkerGeometry(
        num_kv_blocks=1456,
        block_size=16,
        max_context_tokens=2048,
        eos_token_ids=frozenset(),
        vocab_size=49152,
    )
    scheduler = Scheduler(SchedulerConfig(target_step_ms=target_step_ms))
    scheduler.attach_worker(geometry)
    worker = FakeWorker(geometry, check=False)
    rng = random.Random(seed)
    stopping = ValidStopping(
        max_new_tokens=workload.max_new_tokens,
        min_new_tokens=0,
        stop_strings=(),
        stop_token_ids=frozenset(),
        ignore_eos=True,
    )
    arrivals = [
        (index * workload.interval_ms / 1000, f"r{index}") for index in range(workload.num_requests)
    ]
    arrival_s = dict((request_id, at_s) for at_s, request_id in arrivals)
    last_token_s: dict[str, float] = {}
    itl_ms: list[float] = []
    ttft_ms: list[float] = []
    now_s = 0.0
    num_tokens = 0
    pending = list(reversed(arrivals))
    a, b, c = costs
    while pending or scheduler.has_work():
        while pending and pending[-1][0] <= now_s:
            at_s, request_id = pending.pop()
            num_prompt = workload.prompt_tokens[int(request_id[1:]) % len(workload.prompt_tokens)]
            prompt = [rng.randrange(3, 40000) for _ in range(num_prompt)]
            scheduler.add(
                ValidRequest(
                    request_id=request_id,
                    prompt_token_ids=tuple(prompt),
                    sampling=SAMPLING,
                    stopping=stopping,
                    priority=0,
                ),
                at_s,
            )
        plan = scheduler.schedule(now_s)
        if plan is None:
            now_s = pending[-1][0]
            continue
        step_ms = a + b * plan.num_prefill_tokens + c * plan.num_decode_tokens
        step_ms *= math.exp(rng.gauss(0.0, noise))
        if rng.random() < outlier_rate:
            step_ms *= 4.0
        now_s += step_ms / 1000
        result = dataclasses.replace(worker.step(plan), forward_ms=step_ms)
        for output in scheduler.apply(result, now_s):
            request_id = output.request_id
            num_tokens += len(output.token_ids)
            previous_s = last_token_s.get(request_id)
            if previous_s is None:
                ttft_ms.append((now_s - arrival_s[request_id]) * 1000)
            else:
                itl_ms.append((now_s - previous_s) * 1000)
            last_token_s[request_id] = now_s
    return Outcome(num_tokens / now_s, itl_ms, ttft_ms)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", default="int8", help="int8, fp32 or A,B,C (ms)")
    parser.add_argument("--noise", type=float, default=0.1, help="log-normal sigma per step")
    parser.add_argument("--outliers", type=float, default=0.005, help="share of 4x steps")
    parser.add_argument("--targets", default="0,250,500,750,1000")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    costs = COST_PRESETS.get(args.costs) or tuple(float(x) for x in args.costs.split(","))
    targets = [float(x) for x in args.targets.split(",")]
    print(f"costs a={costs[0]} ms + b={costs[1]} ms/prompt token + c={costs[2]} ms/decode seq")
    print(
        f"noise {args.noise}, outliers {args.outliers}, medians over {args.seeds} seeds; "
        "target 0 = off"
    )
    print(
        f"{'workload':15s} {'target':>6s} {'tok/s':>7s} {'ITL p50/p99 ms':>16s} {'TTFT p99 ms':>12s}"
    )
    for workload in WORKLOADS:
        for target in targets:
            outcomes = [
                run(workload, target, costs, args.noise, args.outliers, seed)
                for seed in range(args.seeds)
            ]
            tok_s = sorted(o.tokens_per_s for o in outcomes)[len(outcomes) // 2]
            itl50 = sorted(percentile(o.itl_ms, 0.5) for o in outcomes)[len(outcomes) // 2]
            itl99 = sorted(percentile(o.itl_ms, 0.99) for o in outcomes)[len(outcomes) // 2]
            ttft99 = sorted(percentile(o.ttft_ms, 0.99) for o in outcomes)[len(outcomes) // 2]
            print(
                f"{workload.name:15s} {target:6.0f} {tok_s:7.1f} "
                f"{itl50:7.0f}/{itl99:<8.0f} {ttft99:12.0f}"
            )


if __name__ == "__main__":
    main()
