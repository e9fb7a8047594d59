"""The `prefix` admission policy against `fifo` and `pack`, when the prefix cache cannot
hold every shared prefix: `python -m benchmarks.admission_prefix`.

One worker and scheduler of --model on this machine; a burst of --groups x --per-group
requests, each a shared prefix of ~--prefix-words tokens (a system prompt per group) and a
unique question (--question-words more words), and --singles short prompts that share
nothing, shuffled. --max-active-requests keeps a queue waiting, and
--num-kv-blocks a pool that holds only some of the prefixes, so the order in which the
queue is admitted decides how many prefixes are computed more than once. Each policy gets
prefixes of its own. Reported per policy: the share of prompt tokens served from the
cache, prompt tokens computed, time to first token (mean, p50, p90) and the burst's wall
time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

from benchmarks.router import prefix_text, run_policy, summarize
from benchmarks.suite_service import LocalService, resolve_model_dir


def burst(policy: str, args) -> tuple[list[str], list[float]]:
    question_words = " ".join(["please"] * args.question_words)
    prompts = [
        prefix_text(f"{policy}-{group}", args.prefix_words)
        + f"User {i}: {question_words} what is {i} + {group}?"
        for group in range(args.groups)
        for i in range(args.per_group)
    ]
    # Prompts that share nothing: short, so pack (cheapest first) starts them first.
    prompts += [
        prefix_text(f"{policy}-single-{index}", args.single_words) + "User: hello?"
        for index in range(args.singles)
    ]
    random.Random(args.seed).shuffle(prompts)
    return prompts, [0.0] * len(prompts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.admission_prefix", description=__doc__
    )
    add = parser.add_argument
    add("--model", default="default", help="default, dummy or a directory")
    add("--policies", default="fifo,prefix,pack")
    add("--groups", type=int, default=8)
    add("--per-group", type=int, default=6)
    add("--prefix-words", type=int, default=400, help="words per prefix, about tokens")
    add("--question-words", type=int, default=0, help="more words after each prefix")
    add("--singles", type=int, default=0, help="prompts that share no prefix, mixed in")
    add("--single-words", type=int, default=60, help="words of each of those")
    add("--max-new-tokens", type=int, default=8)
    add("--max-active-requests", type=int, default=4)
    add("--num-kv-blocks", type=int, default=160, help="KV blocks of 16 tokens in the pool")
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(
        f"model {args.model}: {args.groups} prefixes of ~{args.prefix_words} tokens x "
        f"{args.per_group} requests in one burst, max_active_requests "
        f"{args.max_active_requests}, {args.num_kv_blocks} KV blocks"
    )
    print(
        f"{'policy':>7} {'cached':>7} {'computed':>9} {'TTFT mean':>10} {'p50':>7} "
        f"{'p90':>7} {'wall s':>7}"
    )
    with LocalService(
        worker_model=args.model,
        device="cpu",
        model_dir=resolve_model_dir(args.model),
        worker_args=("--num-kv-blocks", str(args.num_kv_blocks)),
    ) as service:
        service.start_worker()
        for policy in args.policies.split(","):
            service.use_scheduler(
                ("--admission-policy", policy,
                 "--max-active-requests", str(args.max_active_requests))
            )  # fmt: skip
            prompts, offsets = burst(policy, args)
            start_s = time.monotonic()
            results = asyncio.run(run_policy(service.address, prompts, offsets, args))
            wall_s = time.monotonic() - start_s
            run = summarize(results)
            print(
                f"{policy:>7} {run.cached_share:>6.1%} {run.computed_tokens:>9} "
                f"{run.ttft_mean_s:>9.2f}s {run.ttft_p50_s:>6.2f}s {run.ttft_p90_s:>6.2f}s "
                f"{wall_s:>7.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
