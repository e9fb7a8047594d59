"""The step budget (--target-step-ms) replayed on a simulated worker: ITL and throughput of a
workload when each step costs a + b * prompt tokens + c * decode sequences + d * KV tokens
read milliseconds.

    .venv/bin/python -m benchmarks.step_budget [--costs int8|fp32|A,B,C,D] [--noise 0.1]
                                 [--outliers 0.005] [--targets 0,250,500,750,1000]
                                 [--kv-read padded|sum]

The scheduler core runs against the in-process fake worker on a simulated clock: the
clock moves by each step's simulated cost, one step at a time (no overlap, no scheduler or
transport time), and the fake worker reports that cost as its forward_ms, so the step
budget learns it as it learns a real worker's. Nothing here depends on the machine's load:
it isolates what the budget does to the step shapes from the noise of a shared CPU. Each
step's cost is multiplied by a log-normal noise of --noise, and a share --outliers of the
steps takes 4x (a GC pause, a neighbour on the cores).

The KV tokens a step reads: each prompt chunk its context (start + tokens), and the
decodes, with --kv-read padded (the CPU reference backend, gather + SDPA), the number of
decodes times the longest decode context (every row is gathered and masked to that
length); with --kv-read sum, each decode its own context (a paged kernel).

The cost presets, the default model on 2 cores: fp32 from the real burst-512-mix steps
(/work/briefs/steps_burst512mix.txt; its 31 decode-only steps of 28 down to 3 decodes,
contexts up to ~540, fit 51 ms + 6.95 ms per decode within 3%) together with issue 15's
forward at context 128 (2.2 ms per decode between batch 32 and 64): 6.95 = c + 540 d and
2.2 = c + 128 d give d = 0.0115 ms per KV token read and c = 0.73 ms; the prompt token is
issue 15's 1.37 ms (a 512-token prefill 763 ms). The file's single decodes agree with the
padded reading (44.5 ms at context ~20, 48.0 ms at 523: 0.007 ms a token) and not with
the sum one (which would need 0.13 ms a token to give 6.95 ms a decode at the tail's mean
context of ~165). int8: issue 15's decode batch 1 18.8 ms, 64 105 ms and 512-token
prefill 341 ms at context 128, with d = 0.008 (the KV stays fp32).

Each target runs twice: with the budget as it is (`ctx`), and with its context feature
held at zero (`blind`: exactly the three-feature model of before, intercept + prompt
tokens + decodes).

Workloads as in benchmarks/scenarios.py: burst-512-mix (64 requests at once, prompts
cycling 512/8/8/8 tokens, 32 new each), burst-short (64 x 32 tokens, 64 new) and
trickle-short (32 x 32 tokens, one every 250 ms, 32 new).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random

from benchmarks.scheduler_core import SAMPLING  # greedy, no penalties
from pagoda.scheduler_svc.core import (
    Scheduler,
    SchedulerConfig,
    StepPlan,
    ValidRequest,
    ValidStopping,
    WorkerGeometry,
)
from pagoda.scheduler_svc.core.step_budget import StepBudget
from pagoda.scheduler_svc.testing import FakeWorker

# ms: intercept, per prompt token, per decode, per KV token read (see the docstring).
COST_PRESETS = {"int8": (18.0, 0.63, 0.35, 0.008), "fp32": (51.0, 1.37, 0.73, 0.0115)}


class ContextBlindBudget(StepBudget):
    """The step budget with its context feature held at zero: the model of before it."""

    __slots__ = ()

    def max_prefill_tokens(
        self, num_decode_seqs: int, num_context_tokens: int = 0, num_rounds: int = 1
    ) -> int | None:
        return StepBudget.max_prefill_tokens(self, num_decode_seqs, 0, num_rounds)

    def observe(
        self,
        num_prefill_tokens: int,
        num_decode_seqs: int,
        step_ms: float,
        num_context_tokens: int = 0,
    ) -> None:
        StepBudget.observe(self, num_prefill_tokens, num_decode_seqs, step_ms, 0)


def kv_tokens_read(plan: StepPlan, padded: bool) -> int:
    """The KV tokens the step's attention reads (decode rows come first in a plan)."""
    num_decode = plan.num_decode_tokens
    num_fed = len(plan.start_positions)
    offsets, starts = plan.token_offsets, plan.start_positions
    decode_context = [starts[i] + 1 for i in range(num_decode)]
    prefill_context = sum(
        starts[i] + offsets[i + 1] - offsets[i] for i in range(num_decode, num_fed)
    )
    if padded:
        return num_decode * max(decode_context, default=0) + prefill_context
    return sum(decode_context) + prefill_context


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
    costs: tuple[float, float, float, float],
    noise: float,
    outlier_rate: float,
    seed: int,
    padded: bool = True,
    blind: bool = False,
    knobs: dict | None = None,
) -> Outcome:
    geometry = WorkerGeometry(
        num_kv_blocks=1456,
        block_size=16,
        max_context_tokens=2048,
        eos_token_ids=frozenset(),
        vocab_size=49152,
    )
    scheduler = Scheduler(SchedulerConfig(target_step_ms=target_step_ms, **(knobs or {})))
    scheduler.attach_worker(geometry)
    if blind and target_step_ms:
        scheduler._step_budget = ContextBlindBudget(target_step_ms)
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
    a, b, c, d = costs
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
        step_ms += d * kv_tokens_read(plan, padded)
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
    parser.add_argument("--costs", default="int8", help="int8, fp32 or A,B,C,D (ms)")
    parser.add_argument(
        "--kv-read",
        choices=("padded", "sum"),
        default="padded",
        help="decodes read the longest decode context each (padded) or their own (sum)",
    )
    parser.add_argument("--noise", type=float, default=0.1, help="log-normal sigma per step")
    parser.add_argument("--outliers", type=float, default=0.005, help="share of 4x steps")
    parser.add_argument("--targets", default="0,250,500,750,1000")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    costs = COST_PRESETS.get(args.costs) or tuple(float(x) for x in args.costs.split(","))
    targets = [float(x) for x in args.targets.split(",")]
    padded = args.kv_read == "padded"
    print(
        f"costs a={costs[0]} ms + b={costs[1]} ms/prompt token + c={costs[2]} ms/decode seq"
        f" + d={costs[3]} ms/KV token read ({args.kv_read})"
    )
    print(
        f"noise {args.noise}, outliers {args.outliers}, medians over {args.seeds} seeds; "
        "target 0 = off"
    )
    print(
        f"{'workload':15s} {'target':>6s} {'model':>5s} {'tok/s':>7s} {'ITL p50/p99 ms':>16s}"
        f" {'TTFT p99 ms':>12s}"
    )
    for workload in WORKLOADS:
        for target, blind in [(t, b) for t in targets for b in ((False, True) if t else (False,))]:
            outcomes = [
                run(workload, target, costs, args.noise, args.outliers, seed, padded, blind)
                for seed in range(args.seeds)
            ]
            tok_s = sorted(o.tokens_per_s for o in outcomes)[len(outcomes) // 2]
            itl50 = sorted(percentile(o.itl_ms, 0.5) for o in outcomes)[len(outcomes) // 2]
            itl99 = sorted(percentile(o.itl_ms, 0.99) for o in outcomes)[len(outcomes) // 2]
            ttft99 = sorted(percentile(o.ttft_ms, 0.99) for o in outcomes)[len(outcomes) // 2]
            model = "-" if not target else "blind" if blind else "ctx"
            print(
                f"{workload.name:15s} {target:6.0f} {model:>5s} {tok_s:7.1f} "
                f"{itl50:7.0f}/{itl99:<8.0f} {ttft99:12.0f}"
            )


if __name__ == "__main__":
    main()
