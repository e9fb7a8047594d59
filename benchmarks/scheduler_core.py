"""Benchmark of the scheduler core: schedule() + apply() + the output processor per step (the
token-id stop rules, detokenization and stop strings), fake worker excluded.

    .venv/bin/python -m benchmarks.scheduler_core [--sizes 16,64,256,1024] [--steps 300]
                                                [--gc service|python] [--tokens uniform|zipf]

Steady state at N running sequences: 128-token prompts, 64-256 generated tokens
(ignore_eos, so lengths are fixed), block size 16, every finished request replaced at
once by a new arrival. Half of the requests carry a stop string (never matched, so the
held-back text logic runs on every token). Text comes from the default model's real
tokenizer through the incremental detokenizer. "pressure" sizes the KV pool at 12 blocks
per sequence, about half of the worst case, so preemption by recompute happens
throughout; "roomy" holds every sequence at its longest. Garbage collection is set up
as the scheduler process sets it up (gc_tuning.tune_gc) unless --gc python.

The fake worker's sampled ids are uniform over the vocabulary, the worst case for the
detokenizer's text table (every lookup a cache miss); real text keeps reusing a few
thousand tokens. `--tokens zipf` maps each sampled id, outside the timed part, to a token
drawn from a Zipf law (exponent 1) over the tokens that are whole characters, in id order
(byte-level BPE numbers its merges about in order of frequency).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pagoda.scheduler_svc.core import (
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    ValidRequest,
    ValidStopping,
    WorkerGeometry,
)
from pagoda.scheduler_svc.detokenizer import IncrementalDetokenizer
from pagoda.scheduler_svc.gc_tuning import tune_gc
from pagoda.scheduler_svc.output_processor import OutputProcessor
from pagoda.scheduler_svc.step_loop import apply_step
from pagoda.scheduler_svc.testing import FakeWorker
from pagoda.scheduler_svc.tokenizer import TextTokenizer, load_tokenizer

BLOCK_SIZE = 16
PROMPT_TOKENS = 128
MIN_NEW_TOKENS, MAX_NEW_TOKENS = 64, 256
PRESSURE_BLOCKS_PER_SEQUENCE = 12
SAMPLING = SamplingParams(
    temperature=0.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    seed=0,
    num_logprobs=0,
)


@dataclass(frozen=True, slots=True)
class Result:
    num_running: int
    pressure: bool
    median_us: float
    p99_us: float
    mean_running: float
    preemptions_per_step: float
    tokens_per_step: float


def default_model_dir() -> Path:
    """The default model's directory, resolved in a child process as the service does."""
    found = subprocess.run(
        [sys.executable, "-c", "from pagoda.gpu_worker.model_loader import resolve_model_dir as r; "
         "print(r('default', provision=False).path)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return Path(found.stdout.strip())


class Workload:
    """Requests with fixed random prompts and lengths, numbered in arrival order."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._vocab_size = vocab_size
        self._count = 0

    def next_request(self) -> ValidRequest:
        rng = self._rng
        self._count += 1
        return ValidRequest(
            request_id=f"bench-{self._count}",
            prompt_token_ids=tuple(
                rng.randrange(3, self._vocab_size) for _ in range(PROMPT_TOKENS)
            ),
            sampling=SAMPLING,
            stopping=ValidStopping(
                max_new_tokens=rng.randint(MIN_NEW_TOKENS, MAX_NEW_TOKENS),
                min_new_tokens=0,
                stop_strings=("<|never|>",) if self._count % 2 else (),
                stop_token_ids=frozenset(),
                ignore_eos=True,
            ),
        )


def zipf_token_map(tokenizer: TextTokenizer, seed: int = 0) -> list[int]:
    """Sampled id -> a token of whole characters drawn by Zipf's law over their id order,
    skipping the 256 single-byte tokens; one entry per id of the vocabulary."""
    texts = tokenizer.token_texts() or []
    ranked = [token_id for token_id, text in enumerate(texts) if text and token_id >= 256]
    weights = [1.0 / rank for rank in range(1, len(ranked) + 1)]
    return random.Random(seed).choices(ranked, weights, k=tokenizer.vocab_size)


def run(
    tokenizer: TextTokenizer,
    num_running: int,
    pressure: bool,
    num_steps: int,
    tuned_gc: bool,
    token_map: list[int] | None = None,
) -> Result:
    worst_case_blocks = -(-(PROMPT_TOKENS + MAX_NEW_TOKENS) // BLOCK_SIZE)
    blocks_per_sequence = PRESSURE_BLOCKS_PER_SEQUENCE if pressure else worst_case_blocks
    geometry = WorkerGeometry(
        num_kv_blocks=num_running * blocks_per_sequence,
        block_size=BLOCK_SIZE,
        max_context_tokens=8192,
        eos_token_ids=tokenizer.eos_token_ids,
        vocab_size=tokenizer.vocab_size,
    )
    config = SchedulerConfig(
        max_num_batched_tokens=num_running + 2048,
        max_active_requests=num_running,
        max_waiting_requests=4 * num_running,
    )
    scheduler = Scheduler(config)
    processor = OutputProcessor(lambda: IncrementalDetokenizer(tokenizer))
    scheduler.attach_worker(geometry)
    worker = FakeWorker(geometry, check=False)
    workload = Workload(tokenizer.vocab_size)
    for _ in range(num_running):
        add(scheduler, processor, workload.next_request(), 0.0)
    # Warm up until the running set is full and finishing times are spread out.
    num_warmup_steps = MAX_NEW_TOKENS + num_running * PROMPT_TOKENS // 2048
    samples_us: list[float] = []
    running: list[int] = []
    tokens: list[int] = []
    preemptions_before = 0
    if tuned_gc:
        tune_gc()  # collects first
    else:
        gc.collect()
    for step in range(num_warmup_steps + num_steps):
        now = float(step)
        if step == num_warmup_steps:
            preemptions_before = scheduler.stats.num_preemptions
        started = time.perf_counter_ns()
        plan = scheduler.schedule(now)
        planned = time.perf_counter_ns()
        assert plan is not None
        result = worker.step(plan)
        if token_map is not None:
            result.token_ids = [token_map[token_id] for token_id in result.token_ids]
        answered = time.perf_counter_ns()
        outputs = apply_step(scheduler, processor, result, now)
        applied = time.perf_counter_ns()
        for output in outputs.outputs:
            if output.finish_reason is not None:
                add(scheduler, processor, workload.next_request(), now)
        if step >= num_warmup_steps:
            samples_us.append(((planned - started) + (applied - answered)) / 1000)
            running.append(len(plan.seq_ids))
            tokens.append(plan.num_tokens)
    samples_us.sort()
    return Result(
        num_running=num_running,
        pressure=pressure,
        median_us=statistics.median(samples_us),
        p99_us=samples_us[min(len(samples_us) - 1, int(0.99 * len(samples_us)))],
        mean_running=statistics.mean(running),
        preemptions_per_step=(scheduler.stats.num_preemptions - preemptions_before) / num_steps,
        tokens_per_step=statistics.mean(tokens),
    )


def add(scheduler: Scheduler, processor: OutputProcessor, request: ValidRequest, now: float):
    """As the serving front admits a request: into the core, then its text state."""
    scheduler.add(request, now)
    processor.open(request)


def markdown(results: list[Result]) -> str:
    lines = [
        "| running | KV pool | sequences / step | tokens / step | preemptions / step "
        "| median µs / step | p99 µs / step | median µs / sequence |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        pool = f"pressure ({PRESSURE_BLOCKS_PER_SEQUENCE} blocks/seq)" if r.pressure else "roomy"
        lines.append(
            f"| {r.num_running} | {pool} | {r.mean_running:.0f} | {r.tokens_per_step:.0f} "
            f"| {r.preemptions_per_step:.2f} | {r.median_us:.0f} | {r.p99_us:.0f} "
            f"| {r.median_us / r.mean_running:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="16,64,256,1024", help="running sequences, comma-separated"
    )
    parser.add_argument("--steps", type=int, default=300, help="measured steps per configuration")
    parser.add_argument(
        "--gc",
        choices=("service", "python"),
        default="service",
        help="service: gc.freeze() and a gen-0 threshold of 100k (tune_gc); python: defaults",
    )
    parser.add_argument(
        "--tokens",
        choices=("uniform", "zipf"),
        default="uniform",
        help="sampled token ids: the fake worker's, uniform over the vocabulary; or mapped "
        "to a Zipf law over whole-character tokens, closer to real text",
    )
    parser.add_argument(
        "--model-dir", type=Path, help="tokenizer directory (default: the default model's)"
    )
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model_dir or default_model_dir())
    token_map = zipf_token_map(tokenizer) if args.tokens == "zipf" else None
    tuned_gc = args.gc == "service"
    results = []
    for num_running in (int(size) for size in args.sizes.split(",")):
        for pressure in (False, True):
            results.append(run(tokenizer, num_running, pressure, args.steps, tuned_gc, token_map))
            print(markdown(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
