"""The load generator's workload: prompts and arrival times, as pure functions of a config."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

from pagoda.client.bench_config import BenchConfig
from pagoda.client.bench_report import BenchReport, RequestResult, summarize

# Very common English words with a leading space: one token each in byte-level BPE
# vocabularies (GPT-2, Llama 3, SmolLM2, Qwen), so one repeat is about one prompt token.
FILLER_WORDS = (" the", " of", " and", " to", " in", " a", " is", " that", " for", " it")


def filler_text(num_words: int) -> str:
    """`num_words` filler words, cycling through FILLER_WORDS from the first."""
    cycle = len(FILLER_WORDS)
    return "".join(FILLER_WORDS[i % cycle] for i in range(num_words))


def build_prompts(config: BenchConfig, run_tag: str) -> list[str]:
    """Request i's prompt, for i in range(config.num_requests).

    unique: "[<run_tag>-<i>]" then the filler, so prompts share no prefix beyond "[".
    shared-prefix: the shared text, then " [<run_tag>-<i>]", then the filler.
    same: "[<run_tag>]" then the filler: identical whenever the repeat counts are.
    """
    fillers = {repeats: filler_text(repeats) for repeats in set(config.prompt_repeats)}
    prompts = []
    for index in range(config.num_requests):
        filler = fillers[config.prompt_repeats[index % len(config.prompt_repeats)]]
        if config.same_prompt:
            prompts.append(f"[{run_tag}]{filler}")
        elif config.shared_prefix is not None:
            prompts.append(f"{config.shared_prefix} [{run_tag}-{index}]{filler}")
        else:
            prompts.append(f"[{run_tag}-{index}]{filler}")
    return prompts


def arrival_offsets_s(config: BenchConfig) -> list[float]:
    """Seconds after the run starts at which each request is sent (open-loop arrivals).

    Closed-loop runs have no schedule (each user sends when its previous request ends) and
    get an empty list.
    """
    count = config.num_requests
    if config.arrival == "burst":
        return [0.0] * count
    if config.arrival == "interval":
        return [index * config.interval_ms / 1000 for index in range(count)]
    if config.arrival == "poisson":
        rng = random.Random(config.seed)
        offsets, now_s = [], 0.0
        for _ in range(count):
            offsets.append(now_s)
            now_s += rng.expovariate(config.rate_per_s)
        return offsets
    return []


async def run_open_loop(
    config: BenchConfig,
    run_tag: str,
    results: list[RequestResult],
    one: Callable[[int], Awaitable[None]],
    now: Callable[[], float],
) -> BenchReport:
    """Start `one(index)` for each request at its arrival offset (arrival_offsets_s), stop at
    `config.duration_s`, and summarize the `results` the calls appended: the open-loop
    driver of the HTTP peers (llama-server's /completion, any OpenAI-compatible server)."""
    try:
        async with asyncio.timeout(config.duration_s), asyncio.TaskGroup() as group:
            for index, offset_s in enumerate(arrival_offsets_s(config)):
                delay_s = offset_s - now()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                group.create_task(one(index))
    except TimeoutError:
        pass
    ends = [r.end_s for r in results if r.end_s is not None]
    unfinished = any(r.unfinished for r in results) or not ends
    duration_s = now() if unfinished else max(ends)
    results.sort(key=lambda r: r.index)
    return summarize(config, run_tag, results, duration_s, num_preemptions=None)
