"""Issue 24 item 9's head-of-line burst replayed on a simulated worker (benchmarks.step_budget's
clock and cost model): pack vs FIFO TTFT p99, and pack with chunked prefill vs FIFO ITL p99.

    .venv/bin/python -m benchmarks.pack_replay [--costs fp32|int8|A,B,C,D] [--seeds 5]

48 requests at once, prompts cycling 520/16/16/16 tokens, 16 new each, at most 8 decodes a
step; `fifo` and `pack` (lookahead 64, every 8th round FIFO) under a 256-token prefill budget
without chunking, `pack, chunked` under 256-token steps. Nothing here depends on the
machine's load; medians over the seeds (each seed draws the step noise).
"""

from __future__ import annotations

import argparse

from benchmarks.step_budget import COST_PRESETS, Workload, percentile, run

BURST = Workload("head-of-line burst", 48, (520, 16, 16, 16), 16)
DECODE_CAP = {"max_decode_batch_size": 8}
PACK = {"admission_policy": "pack", "admission_lookahead": 64, "force_fifo_every": 8}
UNCHUNKED = {**DECODE_CAP, "prefill_max_tokens": 256, "chunked_prefill": False}
VARIANTS = {
    "fifo": {**UNCHUNKED, "admission_policy": "fifo"},
    "pack": {**UNCHUNKED, **PACK},
    "pack, chunked": {**DECODE_CAP, "max_num_batched_tokens": 256, **PACK},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", default="fp32", help="int8, fp32 or A,B,C,D (ms)")
    parser.add_argument("--target", type=float, default=500.0, help="target_step_ms (0: off)")
    parser.add_argument("--noise", type=float, default=0.1, help="log-normal sigma per step")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    costs = COST_PRESETS.get(args.costs) or tuple(float(x) for x in args.costs.split(","))
    p99 = {}
    print(f"{'variant':14s} {'TTFT p50/p99 ms':>18s} {'ITL p50/p99 ms':>16s}")
    for label, knobs in VARIANTS.items():
        outcomes = [
            run(BURST, args.target, costs, args.noise, 0.0, seed, knobs=knobs)
            for seed in range(args.seeds)
        ]
        middle = len(outcomes) // 2
        stats = {
            name: sorted(percentile(getattr(o, field), q) for o in outcomes)[middle]
            for name, field, q in (
                ("ttft50", "ttft_ms", 0.5),
                ("ttft99", "ttft_ms", 0.99),
                ("itl50", "itl_ms", 0.5),
                ("itl99", "itl_ms", 0.99),
            )
        }
        p99[label] = stats
        print(
            f"{label:14s} {stats['ttft50']:8.0f}/{stats['ttft99']:<9.0f}"
            f" {stats['itl50']:7.0f}/{stats['itl99']:<8.0f}"
        )
    print(
        f"pack/fifo TTFT p99 {p99['pack']['ttft99'] / p99['fifo']['ttft99']:.2f}, "
        f"chunked/fifo ITL p99 {p99['pack, chunked']['itl99'] / p99['fifo']['itl99']:.2f}"
    )


if __name__ == "__main__":
    main()
