"""Throughput with and without a constraint on every request, on the dummy worker:
`python -m benchmarks.constrained_throughput [--dummy-step-ms 20] [--rounds 3]`.

Starts a dummy worker whose every step takes --dummy-step-ms (a simulated forward) and a
scheduler (overlapped steps: the dummy worker is not a CPU one), then runs rounds of
--streams concurrent greedy Generate calls of --max-new-tokens tokens each, alternately
unconstrained and with a regex constraint on every request (lowercase words: each request
still generates all its tokens, every one under a mask). Prints the generated tokens per
second of each round and the best of each setting: both in one sitting, on the same
processes. Issue 28's goal: constrained within 10% of unconstrained.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from benchmarks.suite_service import LocalService, resolve_model_dir
from pagoda.client import AsyncClient

# Lowercase letters and blanks: EOS is allowed after the first, but the dummy worker takes
# the first allowed id at or above its pick, which is EOS (2) about never.
REGEX = "[a-z ]+"
PROMPTS = ["The quick brown fox", "Paris is", "Write a haiku about", "salt wind over"]


async def one_round(
    address: str, num_streams: int, max_new_tokens: int, constraint: dict | None
) -> tuple[int, float]:
    """(tokens generated, seconds) of `num_streams` concurrent requests."""
    options = {"max_new_tokens": max_new_tokens}
    if constraint is not None:
        options["constraint"] = constraint
    async with AsyncClient(address, timeout_s=300) as client:
        started_s = time.perf_counter()
        completions = await asyncio.gather(
            *(
                client.complete(f"{PROMPTS[i % len(PROMPTS)]} {i}", **options)
                for i in range(num_streams)
            )
        )
        elapsed_s = time.perf_counter() - started_s
    return sum(len(c.token_ids) for c in completions), elapsed_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.constrained_throughput", description=__doc__
    )
    parser.add_argument("--dummy-step-ms", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each setting")
    parser.add_argument("--scheduler-args", default="", help="more scheduler flags, one string")
    args = parser.parse_args(argv)
    model_dir = resolve_model_dir("default")
    worker_args = ("--dummy-step-ms", str(args.dummy_step_ms))
    print(
        f"dummy worker, {args.dummy_step_ms:g} ms steps, {args.streams} concurrent greedy "
        f"requests of {args.max_new_tokens} tokens; regex {REGEX!r} when constrained"
    )
    with LocalService(
        worker_model="dummy", device="cpu", model_dir=model_dir, worker_args=worker_args
    ) as service:
        service.start_worker()
        service.use_scheduler(tuple(args.scheduler_args.split()))
        # The first constraint reads the vocabulary (about a second): not in any round.
        asyncio.run(one_round(service.address, 1, 2, {"regex": REGEX}))
        rates: dict[str, list[float]] = {"unconstrained": [], "regex": []}
        for _ in range(args.rounds):
            for name, constraint in (("unconstrained", None), ("regex", {"regex": REGEX})):
                tokens, seconds = asyncio.run(
                    one_round(service.address, args.streams, args.max_new_tokens, constraint)
                )
                rates[name].append(tokens / seconds)
                print(f"{name:<14} {tokens:>6} tokens in {seconds:6.2f} s: "
                      f"{tokens / seconds:7.0f} tokens/s", flush=True)  # fmt: skip
    free, constrained = (max(rates[name]) for name in ("unconstrained", "regex"))
    print(f"best of {args.rounds}: {free:.0f} tokens/s unconstrained, {constrained:.0f} "
          f"with the regex ({constrained / free - 1:+.0%})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
