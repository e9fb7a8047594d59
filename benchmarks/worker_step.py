"""Worker micro-benchmark: the paged engine next to transformers' own forward with its
DynamicCache, on the same shapes, in the same run.

  .venv/bin/python -m benchmarks.worker_step [--model default] [--write-docs docs/benchmarks.md]

Cases: decode steps at batch 1/8/32/64 with 128-token contexts; prefill of 128/512/2048
tokens; one mixed step (a 512-token chunk + 32 decodes) against the two run separately.
Decode contexts are set up as cached prefixes (the timing does not depend on the KV
values), so no time goes into building them. Times are medians of a few repeats after
one warm-up. A benchmark, not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from pagoda.gpu_worker import codec
from pagoda.gpu_worker.model_loader import load_model, resolve_model_dir
from pagoda.gpu_worker.paged_engine import PagedEngine, pick_device
from pagoda.protos import step_pb2

BLOCK_SIZE = 16
CONTEXT_TOKENS = 128
DECODE_BATCHES = (1, 8, 32, 64)
PREFILL_LENGTHS = (128, 512, 2048)
MIXED_CHUNK_TOKENS = 512
MIXED_DECODES = 32


@dataclass(slots=True)
class Row:
    case: str
    pagoda_ms: float
    transformers_ms: float | None
    tokens: int  # tokens fed per step

    @property
    def pagoda_tokens_per_s(self) -> float:
        return self.tokens / self.pagoda_ms * 1e3

    @property
    def transformers_tokens_per_s(self) -> float | None:
        if self.transformers_ms is None:
            return None
        return self.tokens / self.transformers_ms * 1e3


def median_ms(*runs: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Median time of each run; the runs alternate, so background load hits all alike."""
    for _ in range(warmup):
        for run in runs:
            run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, samples in zip(runs, times, strict=True):
            started_s = time.perf_counter()
            run()
            samples.append((time.perf_counter() - started_s) * 1e3)
    return [statistics.median(samples) for samples in times]


class Plans:
    """Hand-built plans with a bump allocator (sequences are never freed here)."""

    def __init__(self) -> None:
        self.next_block = 0
        self.next_seq_id = 0
        self.tables: dict[int, list[int]] = {}

    def blocks(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // BLOCK_SIZE)
        self.next_block += count
        return list(range(self.next_block - count, self.next_block))

    def new_sequences(self, plan: step_pb2.StepPlan, cached: list[int], num_tokens: int) -> int:
        seq_id = self.next_seq_id
        self.next_seq_id += 1
        self.tables[seq_id] = self.blocks(num_tokens)
        plan.new_sequences.add(
            seq_id=seq_id, cached_token_ids=cached, num_prompt_tokens=len(cached) or num_tokens
        )
        return seq_id

    @staticmethod
    def entry(plan, seq_id: int, start: int, tokens: list[int], blocks: list[int]) -> None:
        if not plan.token_offsets:
            plan.token_offsets.append(0)
            plan.block_offsets.append(0)
        plan.seq_ids.append(seq_id)
        plan.start_positions.append(start)
        plan.sample.append(True)
        plan.token_ids.extend(tokens)
        plan.token_offsets.append(len(plan.token_ids))
        plan.block_ids.extend(blocks)
        plan.block_offsets.append(len(plan.block_ids))


def random_tokens(count: int, generator: torch.Generator, vocab_size: int) -> list[int]:
    return torch.randint(3, vocab_size, (count,), generator=generator).tolist()


class Bench:
    def __init__(self, engine: PagedEngine, reference, repeats: int) -> None:
        self.engine = engine
        self.reference = reference  # the same weights with stock (sdpa) attention
        self.repeats = repeats
        self.plans = Plans()
        self.generator = torch.Generator().manual_seed(0)
        self.vocab_size = engine.facts.vocab_size
        self.decode_ids: list[int] = []  # the last decode case's sequences, reused by mixed

    def _step(self, plan: step_pb2.StepPlan) -> step_pb2.StepResult:
        """One wire plan through the codec and the engine, as the worker's server runs it."""
        result = codec.encode_result(self.engine.step(codec.decode_plan(plan)))
        assert not result.step_error and not result.errors, (result.step_error, result.errors)
        return result

    def decode_sequences(self, batch: int) -> list[int]:
        """`batch` sequences with 127 cached tokens, ready to feed position 127."""
        plan = step_pb2.StepPlan()
        seq_ids = []
        for _ in range(batch):
            cached = random_tokens(CONTEXT_TOKENS - 1, self.generator, self.vocab_size)
            seq_id = self.plans.new_sequences(plan, cached, CONTEXT_TOKENS)
            Plans.entry(plan, seq_id, CONTEXT_TOKENS - 1, [5], self.plans.tables[seq_id])
            seq_ids.append(seq_id)
        self._step(plan)  # registers them (and warms up)
        return seq_ids

    def decode_plan(self, seq_ids: list[int]) -> step_pb2.StepPlan:
        # Rewinding to position 127 every time keeps the context at exactly 128 tokens.
        plan = step_pb2.StepPlan()
        for seq_id in seq_ids:
            Plans.entry(plan, seq_id, CONTEXT_TOKENS - 1, [5], [])
        return plan

    def prefill_plan(
        self, num_tokens: int, seq_id: int | None = None
    ) -> tuple[int, step_pb2.StepPlan]:
        plan = step_pb2.StepPlan()
        blocks: list[int] = []
        if seq_id is None:
            seq_id = self.plans.new_sequences(plan, [], num_tokens)
            blocks = self.plans.tables[seq_id]
        Plans.entry(
            plan, seq_id, 0, random_tokens(num_tokens, self.generator, self.vocab_size), blocks
        )
        return seq_id, plan

    def decode(self, batch: int) -> Row:
        self.decode_ids = self.decode_sequences(batch)
        plan = self.decode_plan(self.decode_ids)
        pagoda_ms, transformers_ms = median_ms(
            lambda: self._step(plan), self._transformers_decode(batch), repeats=self.repeats
        )
        return Row(
            f"decode, batch {batch}, context {CONTEXT_TOKENS}", pagoda_ms, transformers_ms, batch
        )

    def _transformers_decode(self, batch: int) -> Callable[[], None]:
        from transformers import DynamicCache

        geometry = self.engine.pool.geometry
        cache = DynamicCache(config=self.reference.config)
        past = torch.zeros(batch, geometry.num_kv_heads, CONTEXT_TOKENS - 1, geometry.head_dim)
        with torch.inference_mode():
            for layer in range(geometry.num_layers):
                cache.update(past.clone(), past.clone(), layer)
        input_ids = torch.full((batch, 1), 5)
        mask = torch.ones(batch, CONTEXT_TOKENS, dtype=torch.long)
        positions = torch.full((batch, 1), CONTEXT_TOKENS - 1)

        @torch.inference_mode()
        def step() -> None:
            self.reference(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
            cache.crop(-1)  # back to a 127-token past: every repeat has the same shapes

        return step

    def prefill(self, num_tokens: int) -> Row:
        repeats = max(1, self.repeats // (1 + num_tokens // 512))
        seq_id, first = self.prefill_plan(num_tokens)
        self._step(first)
        _, again = self.prefill_plan(num_tokens, seq_id)  # rewinds to position 0
        input_ids = torch.tensor([list(again.token_ids)])

        @torch.inference_mode()
        def transformers_prefill() -> None:
            # logits_to_keep=1: what generate() does, and what the engine computes.
            self.reference(input_ids=input_ids, use_cache=True, logits_to_keep=1)

        pagoda_ms, transformers_ms = median_ms(
            lambda: self._step(again), transformers_prefill, repeats=repeats, warmup=0
        )
        return Row(f"prefill, {num_tokens} tokens", pagoda_ms, transformers_ms, num_tokens)

    def mixed(self) -> list[Row]:
        decode_ids = self.decode_ids[:MIXED_DECODES]
        if len(decode_ids) < MIXED_DECODES:
            decode_ids = self.decode_sequences(MIXED_DECODES)
        seq_id, first = self.prefill_plan(MIXED_CHUNK_TOKENS)
        self._step(first)
        _, chunk = self.prefill_plan(MIXED_CHUNK_TOKENS, seq_id)
        decode = self.decode_plan(decode_ids)
        mixed = step_pb2.StepPlan()
        mixed.CopyFrom(decode)
        Plans.entry(mixed, seq_id, 0, list(chunk.token_ids), [])
        mixed_ms, chunk_ms, decode_ms = median_ms(
            lambda: self._step(mixed),
            lambda: self._step(chunk),
            lambda: self._step(decode),
            repeats=self.repeats,
        )
        tokens = MIXED_CHUNK_TOKENS + MIXED_DECODES
        label = f"{MIXED_CHUNK_TOKENS}-token chunk + {MIXED_DECODES} decodes"
        return [
            Row(f"mixed: {label}, one step", mixed_ms, None, tokens),
            Row(f"mixed: {label}, two steps (sum)", chunk_ms + decode_ms, None, tokens),
            Row(
                f"  the {MIXED_CHUNK_TOKENS}-token chunk alone", chunk_ms, None, MIXED_CHUNK_TOKENS
            ),
            Row(f"  the {MIXED_DECODES} decodes alone", decode_ms, None, MIXED_DECODES),
        ]


def render_table(rows: list[Row]) -> str:
    lines = [
        "| case | pagoda ms/step | transformers ms/step | pagoda tokens/s | transformers tokens/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        theirs_ms = f"{row.transformers_ms:.1f}" if row.transformers_ms is not None else "n/a"
        theirs_tps = row.transformers_tokens_per_s
        lines.append(
            f"| {row.case} | {row.pagoda_ms:.1f} | {theirs_ms} | {row.pagoda_tokens_per_s:.0f} | "
            f"{f'{theirs_tps:.0f}' if theirs_tps is not None else 'n/a'} |"
        )
    return "\n".join(lines)


def write_docs(path: Path, section: str) -> None:
    """Replace (or append) the '## Worker' section of `path`."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(r"^## Worker\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.worker_step", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="default", help="model spec, as for the worker")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per case (median)")
    parser.add_argument(
        "--write-docs", type=Path, help="replace the '## Worker' section of this file"
    )
    args = parser.parse_args(argv)

    device = pick_device(args.device)
    resolved = resolve_model_dir(args.model)
    reference = load_model(resolved, device)
    engine = PagedEngine(load_model(resolved, device), model_id=resolved.model_id,
                         num_kv_blocks=1536, block_size=BLOCK_SIZE)  # fmt: skip
    bench = Bench(engine, reference, args.repeats)
    started_s = time.monotonic()
    rows = [bench.decode(batch) for batch in DECODE_BATCHES]
    rows += [bench.prefill(num_tokens) for num_tokens in PREFILL_LENGTHS]
    rows += bench.mixed()
    table = render_table(rows)
    machine = (
        f"{os.cpu_count()} cores {platform.machine()} CPU, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)"
        if device == "cpu"
        else torch.cuda.get_device_name()
    )
    summary = (
        f"{resolved.model_id}, {engine.facts.dtype} on {device}; {machine}; "
        f"block size {BLOCK_SIZE}; median of {args.repeats} repeats "
        f"(fewer for long prefills); run took {time.monotonic() - started_s:.0f} s."
    )
    print(summary)
    print(table)
    if args.write_docs:
        section = (
            "## Worker\n\n"
            f"`python -m benchmarks.worker_step`, {datetime.date.today().isoformat()}: {summary}\n\n"
            "transformers = the same model's own forward with its `DynamicCache` (sdpa), "
            "same shapes, same run: decode as a padded `[B, 1]` batch over a 127-token cache; "
            "prefill with `logits_to_keep=1` as `generate()` does. A mixed step feeds "
            "both the chunk and the decodes in one forward; two steps is the sum of "
            "the chunk alone and the decodes alone.\n\n"
            f"{table}\n"
        )
        write_docs(args.write_docs, section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
