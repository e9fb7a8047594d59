"""Two replicas behind pagoda-router, one policy against another: `python -m
benchmarks.router`.

Starts two replicas on this machine (each a scheduler and a worker of --model, pinned to
a CPU of its own when there are two, OMP_NUM_THREADS=1) and, for each --policies entry, a
router in front of them. The workload is what prefix-aware routing is for: --groups long
shared prefixes (a system prompt each, --prefix-words words of about one token each),
each followed by --per-group short unique questions, sent in a shuffled order at
--rate-per-s (Poisson arrivals), greedy, --max-new-tokens each. Each policy gets prefixes
of its own, so no run finds another's in cache. Reported per policy: the share of prompt
tokens served from the replicas' prefix caches and the prompt tokens computed, time to
first token (mean, p50, p90), the wall time of the whole run, and how the requests split
over the replicas.

With --num-kv-blocks below what every prefix on both replicas needs, a policy that sends
every prefix everywhere evicts what a prefix-aware one keeps: the two replicas' caches
then add up for cache-aware routing, and duplicate each other otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc

from benchmarks.suite_service import (
    REPO_ROOT,
    LocalService,
    free_port,
    resolve_model_dir,
    stop_process,
    wait_serving,
)
from pagoda.client.bench_report import percentile
from pagoda.protos import generation_pb2, generation_pb2_grpc

# Common English words, about one token each in byte-level BPE vocabularies.
WORDS = [
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
]


def prefix_text(seed: str, num_words: int) -> str:
    rng = random.Random(seed)
    return "System: " + " ".join(rng.choice(WORDS) for _ in range(num_words)) + "\n"


async def one_request(stub, prompt: str, max_new_tokens: int, start_s: float) -> dict:
    request = generation_pb2.GenerateRequest(
        prompt=prompt,
        sampling=generation_pb2.SamplingParams(temperature=0.0),
        stopping=generation_pb2.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
    )
    sent_s = time.monotonic()
    first_s = None
    async for response in stub.Generate(request, timeout=600):
        if first_s is None and response.token_ids:
            first_s = time.monotonic()
        last = response
    return {
        "ttft_s": first_s - sent_s,
        "prompt_tokens": last.usage.prompt_tokens,
        "cached_tokens": last.usage.cached_prompt_tokens,
        "sent_s": sent_s - start_s,
    }


async def run_policy(address: str, prompts: list[str], offsets_s: list[float], args) -> list[dict]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        start_s = time.monotonic()

        async def at(offset_s: float, prompt: str) -> dict:
            await asyncio.sleep(offset_s)
            return await one_request(stub, prompt, args.max_new_tokens, start_s)

        return await asyncio.gather(*(at(o, p) for o, p in zip(offsets_s, prompts, strict=True)))


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One run's figures from its requests' results (one_request's dicts)."""

    cached_share: float  # prompt tokens served from a prefix cache / prompt tokens
    computed_tokens: int  # prompt tokens prefilled
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float


def summarize(results: list[dict]) -> RunSummary:
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    cached_tokens = sum(r["cached_tokens"] for r in results)
    ttfts = sorted(r["ttft_s"] for r in results)
    return RunSummary(
        cached_share=cached_tokens / prompt_tokens,
        computed_tokens=prompt_tokens - cached_tokens,
        ttft_mean_s=sum(ttfts) / len(ttfts),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
    )


def workload(policy: str, args) -> tuple[list[str], list[float]]:
    rng = random.Random(args.seed)
    prompts = [
        prefix_text(f"{policy}-{group}", args.prefix_words) + f"User {i}: what is {i} + {group}?"
        for group in range(args.groups)
        for i in range(args.per_group)
    ]
    rng.shuffle(prompts)
    offsets, now_s = [], 0.0
    for _ in prompts:
        offsets.append(now_s)
        now_s += rng.expovariate(args.rate_per_s)
    return prompts, offsets


def finished_per_replica(replicas: list[LocalService]) -> list[int]:
    counts = []
    for replica in replicas:
        with grpc.insecure_channel(replica.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            stats = stub.GetServerStats(generation_pb2.ServerStatsRequest(), timeout=10)
            counts.append(stats.num_requests_finished)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router", description=__doc__)
    add = parser.add_argument
    add("--model", default="default", help="default, dummy or a directory")
    add("--policies", default="cache-aware,least-loaded,round-robin")
    add("--groups", type=int, default=12, help="distinct shared prefixes")
    add("--per-group", type=int, default=5, help="requests per prefix")
    add("--prefix-words", type=int, default=480, help="words per prefix, about tokens")
    add("--rate-per-s", type=float, default=2.0)
    add("--max-new-tokens", type=int, default=16)
    add("--num-kv-blocks", type=int, default=None, help="KV blocks per replica (default: roomy)")
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model_dir = resolve_model_dir(args.model)
    os.environ["OMP_NUM_THREADS"] = "1"  # the workers inherit it: one core each
    cpus = sorted(os.sched_getaffinity(0))
    worker_args = () if args.num_kv_blocks is None else ("--num-kv-blocks", str(args.num_kv_blocks))
    replicas = [
        LocalService(
            worker_model=args.model,
            device="cpu",
            model_dir=model_dir,
            worker_args=worker_args,
            cpus=frozenset({cpus[i % len(cpus)]}) if len(cpus) >= 2 else None,
        )
        for i in range(2)
    ]
    try:
        for replica in replicas:
            replica.start_worker()
            replica.use_scheduler(())
        print(
            f"model {args.model}, 2 replicas, {args.groups} prefixes of ~{args.prefix_words} "
            f"tokens x {args.per_group} requests, {args.rate_per_s:g}/s, "
            f"KV blocks per replica: {args.num_kv_blocks or 'default'}"
        )
        print(
            f"{'policy':>13} {'cached':>7} {'computed':>9} {'TTFT mean':>10} {'p50':>7} "
            f"{'p90':>7} {'wall s':>7} {'split':>8}"
        )
        for policy in args.policies.split(","):
            address = f"127.0.0.1:{free_port()}"
            backends = ",".join(replica.address for replica in replicas)
            argv = [sys.executable, "-m", "pagoda.router", "--listen", address,
                    "--backends", backends, "--policy", policy, "--log-level", "WARNING"]  # fmt: skip
            router = subprocess.Popen(argv, cwd=REPO_ROOT)
            try:
                wait_serving(address, [router])
                before = finished_per_replica(replicas)
                prompts, offsets = workload(policy, args)
                start_s = time.monotonic()
                results = asyncio.run(run_policy(address, prompts, offsets, args))
                wall_s = time.monotonic() - start_s
                split = [a - b for a, b in zip(finished_per_replica(replicas), before, strict=True)]
            finally:
                stop_process(router)
            run = summarize(results)
            print(
                f"{policy:>13} {run.cached_share:>6.1%} {run.computed_tokens:>9} "
                f"{run.ttft_mean_s * 1000:>8.0f}ms {run.ttft_p50_s * 1000:>5.0f}ms "
                f"{run.ttft_p90_s * 1000:>5.0f}ms {wall_s:>7.1f} {split[0]:>4}/{split[1]}"
            )
    finally:
        for replica in replicas:
            replica.stop()
            replica.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
