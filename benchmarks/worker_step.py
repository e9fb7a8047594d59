"""Worker micro-benchmark: the paged engine next to transformers' own forward with its
DynamicCache, on the same shapes, in the same run.

  .venv/bin/python -m benchmarks.worker_step [--model default] [--device cpu|cuda]
      [--quantization auto|none|int8] [--decode-batches 1,8] [--contexts 128,4096]
      [--write-docs docs/benchmarks.md]

Cases: decode steps at each batch x context (CPU: batch 1/8/32/64, context 128; CUDA:
batch 1..256, contexts 128/1024/4096, less those whose K/V does not fit the card), each
beside its roofline (weights + K/V read once at the memory's bandwidth); prefill of 128/512/2048 tokens; one mixed step (a
512-token chunk + 32 decodes) against the two run separately. Decode contexts are set up
as cached prefixes (the timing does not depend on the KV values), so no time goes into
building them. Both sides run the same weights, dtype and quantization on the same device;
on CUDA every timed run ends with a synchronize. Pagoda's side is the production path: the
attention backend and CUDA graphs the worker picks (`--attention-backend`, `--no-cuda-graphs`). Times are medians of a few repeats after
one warm-up. A benchmark, not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import docs_section
from pagoda.common import step_codec
from pagoda.common.step import StepPlan
from pagoda.gpu_worker.config import LAUNCH_AHEAD, resolves_launch_ahead
from pagoda.gpu_worker.cuda_graphs import CAPTURE_BUDGET_S
from pagoda.gpu_worker.model_loader import load_model, resolve_model_dir
from pagoda.gpu_worker.paged_engine import PagedEngine, pick_device
from pagoda.gpu_worker.quantization import quantize, resolve_quantization
from pagoda.protos import step_pb2

BLOCK_SIZE = 16
DECODE_BATCHES = {"cpu": (1, 8, 32, 64), "cuda": (1, 8, 32, 64, 128, 256)}
DECODE_CONTEXTS = {"cpu": (128,), "cuda": (128, 1024, 4096)}
# transformers' DynamicCache holds a second copy of every context: past this many cached
# tokens in one case, its side is left out (n/a) rather than run out of memory.
MAX_REFERENCE_CONTEXT_TOKENS = 1 << 18
PREFILL_LENGTHS = (128, 512, 2048)
MIXED_CHUNK_TOKENS = 512
MIXED_DECODES = 32
PIECEWISE_TOKENS = 2048  # the worker's default --max-num-batched-tokens: its buckets
# Decode steps launched back to back, each before the one before it is read (--launch-ahead).
AHEAD_STEPS = 8


# Memory bandwidth from the data sheets (SXM parts); another device's is measured by a copy.
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


@dataclass(slots=True)
class Row:
    case: str
    pagoda_ms: float
    transformers_ms: float | None
    tokens: int  # tokens fed per step
    roofline_ms: float | None = None  # decode: weights + the batch's K/V read once

    @property
    def pagoda_tokens_per_s(self) -> float:
        return self.tokens / self.pagoda_ms * 1e3

    @property
    def transformers_tokens_per_s(self) -> float | None:
        if self.transformers_ms is None:
            return None
        return self.tokens / self.transformers_ms * 1e3


@functools.cache
def memory_bytes_per_s(device: torch.device) -> float:
    """The device's memory bandwidth: a data-sheet figure for a known GPU, else the rate of
    one large copy (bytes read plus bytes written)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for card, rate in HBM_BYTES_PER_S.items():
            if card in name:
                return rate
    source = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    (copy_ms,) = median_ms(source.clone, repeats=5)
    return 2 * source.numel() / (copy_ms / 1e3)


def decode_roofline_ms(engine: PagedEngine, batch: int, context: int) -> float:
    """A decode step's floor: every weight byte read once, plus each sequence's K/V, at the
    device's memory bandwidth."""
    tensors = [*engine.model.parameters(), *engine.model.buffers()]
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
    geometry = engine.pool.geometry
    kv_bytes = batch * context * geometry.bytes_per_block // geometry.block_size
    return (weight_bytes + kv_bytes) / memory_bytes_per_s(engine.device) * 1e3


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def median_ms(*runs: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Median time of each run; the runs alternate, so background load hits all alike.
    On CUDA each run is timed to its completion on the device, not to its last launch."""
    for _ in range(warmup):
        for run in runs:
            run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, samples in zip(runs, times, strict=True):
            _synchronize()
            started_s = time.perf_counter()
            run()
            _synchronize()
            samples.append((time.perf_counter() - started_s) * 1e3)
    return [statistics.median(samples) for samples in times]


def launched_ahead_ms(
    engine: PagedEngine, plan_at: Callable[[int], StepPlan], num_steps: int
) -> float:
    """Mean milliseconds a step takes when each plan_at(k), k < num_steps, is launched
    before the one before it is read (engine.py, --launch-ahead), to the device's end of
    the last. Every step must run whole (no step error, no refused row)."""
    launched = None
    _synchronize()
    started_s = time.perf_counter()
    for k in range(num_steps + 1):
        following = engine.launch(plan_at(k)) if k < num_steps else None
        if launched is not None:
            result = engine.read(launched)
            assert not result.step_error and not result.errors, (result.step_error, result.errors)
        launched = following
    _synchronize()
    return (time.perf_counter() - started_s) * 1e3 / num_steps


class Plans:
    """Hand-built plans with a bump allocator (sequences are never freed here)."""

    def __init__(self) -> None:
        self.next_block = 0
        self.next_seq_id = 0
        self.tables: dict[int, list[int]] = {}

    def reset_blocks(self) -> None:
        """Every sequence was forgotten: blocks are free again."""
        self.next_block = 0
        self.tables.clear()

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
        self.device = engine.device
        self.dtype = engine.pool.geometry.dtype

    def forget_all(self) -> None:
        """Forget every sequence (a plan with no entries), so the next case starts at block 0."""
        plan = step_pb2.StepPlan(forget_seq_ids=list(self.plans.tables))
        self._step(plan)
        self.plans.reset_blocks()

    def _step(self, plan: step_pb2.StepPlan) -> step_pb2.StepResult:
        """One wire plan through the codec and the engine, as the worker's server runs it."""
        result = step_codec.encode_result(self.engine.step(step_codec.decode_plan(plan)))
        assert not result.step_error and not result.errors, (result.step_error, result.errors)
        return result

    def decode_sequences(self, batch: int, context: int) -> list[int]:
        """`batch` sequences with context - 1 cached tokens, ready to feed position context - 1."""
        plan = step_pb2.StepPlan()
        seq_ids = []
        for _ in range(batch):
            cached = random_tokens(context - 1, self.generator, self.vocab_size)
            seq_id = self.plans.new_sequences(plan, cached, context)
            Plans.entry(plan, seq_id, context - 1, [5], self.plans.tables[seq_id])
            seq_ids.append(seq_id)
        self._step(plan)  # registers them (and warms up)
        return seq_ids

    @staticmethod
    def decode_plan(seq_ids: list[int], context: int) -> step_pb2.StepPlan:
        # Rewinding to position context - 1 every time keeps the context fixed.
        plan = step_pb2.StepPlan()
        for seq_id in seq_ids:
            Plans.entry(plan, seq_id, context - 1, [5], [])
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

    def decode(self, batch: int, context: int) -> list[Row]:
        """A decode step timed alone; when the engine launches ahead (the worker's way on
        CUDA), also steps launched back to back."""
        seq_ids = self.decode_sequences(batch, context)
        plan = self.decode_plan(seq_ids, context)
        runs = [lambda: self._step(plan)]
        if batch * context <= MAX_REFERENCE_CONTEXT_TOKENS:
            runs.append(self._transformers_decode(batch, context))
        times = median_ms(*runs, repeats=self.repeats)
        transformers_ms = times[1] if len(times) > 1 else None
        case = f"decode, batch {batch}, context {context}"
        roofline_ms = decode_roofline_ms(self.engine, batch, context)
        rows = [Row(case, times[0], transformers_ms, batch, roofline_ms)]
        if self.engine.launches_ahead:
            ahead_ms = self.decode_ahead(seq_ids, context)
            rows.append(Row(f"{case}, launched ahead", ahead_ms, None, batch, roofline_ms))
        self.forget_all()
        return rows

    def decode_ahead(self, seq_ids: list[int], context: int) -> float:
        """Milliseconds a decode step takes when each is launched before the one before it
        is read, its rows fed that step's tokens on the device: AHEAD_STEPS steps at
        positions context, context + 1, ... (each sequence sampled its token at `context`
        in the steps timed before)."""

        def plan_at(k: int) -> StepPlan:
            position = context + k
            plan = step_pb2.StepPlan()
            for seq_id in seq_ids:
                table = self.plans.tables[seq_id]
                new_blocks = []
                if position >= len(table) * BLOCK_SIZE:
                    new_blocks = self.plans.blocks(BLOCK_SIZE)
                    table.extend(new_blocks)
                Plans.entry(plan, seq_id, position, [0], new_blocks)
            plan.last_sampled_rows.extend(range(len(seq_ids)))
            return step_codec.decode_plan(plan)

        return launched_ahead_ms(self.engine, plan_at, AHEAD_STEPS)

    def _transformers_decode(self, batch: int, context: int) -> Callable[[], None]:
        from transformers import DynamicCache

        geometry = self.engine.pool.geometry
        device = self.device
        cache = DynamicCache(config=self.reference.config)
        past_shape = (batch, geometry.num_kv_heads, context - 1, geometry.head_dim)
        past = torch.zeros(past_shape, dtype=self.dtype, device=device)
        with torch.inference_mode():
            for layer in range(geometry.num_layers):
                cache.update(past.clone(), past.clone(), layer)
        del past
        input_ids = torch.full((batch, 1), 5, device=device)
        mask = torch.ones(batch, context, dtype=torch.long, device=device)
        positions = torch.full((batch, 1), context - 1, device=device)

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
        input_ids = torch.tensor([list(again.token_ids)], device=self.device)

        @torch.inference_mode()
        def transformers_prefill() -> None:
            # logits_to_keep=1: what generate() does, and what the engine computes.
            self.reference(input_ids=input_ids, use_cache=True, logits_to_keep=1)

        pagoda_ms, transformers_ms = median_ms(
            lambda: self._step(again), transformers_prefill, repeats=repeats, warmup=0
        )
        self.forget_all()
        return Row(f"prefill, {num_tokens} tokens", pagoda_ms, transformers_ms, num_tokens)

    def mixed(self, context: int) -> list[Row]:
        decode_ids = self.decode_sequences(MIXED_DECODES, context)
        seq_id, first = self.prefill_plan(MIXED_CHUNK_TOKENS)
        self._step(first)
        _, chunk = self.prefill_plan(MIXED_CHUNK_TOKENS, seq_id)
        decode = self.decode_plan(decode_ids, context)
        mixed = step_pb2.StepPlan()
        mixed.CopyFrom(decode)
        Plans.entry(mixed, seq_id, 0, list(chunk.token_ids), [])
        mixed_ms, chunk_ms, decode_ms = median_ms(
            lambda: self._step(mixed),
            lambda: self._step(chunk),
            lambda: self._step(decode),
            repeats=self.repeats,
        )
        self.forget_all()
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
        "| case | pagoda ms/step | transformers ms/step | pagoda tokens/s | "
        "transformers tokens/s | roofline ms | pagoda / roofline |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        theirs_ms = f"{row.transformers_ms:.1f}" if row.transformers_ms is not None else "n/a"
        theirs_tps = row.transformers_tokens_per_s
        roof = "" if row.roofline_ms is None else f"{row.roofline_ms:.2f}"
        ratio = "" if row.roofline_ms is None else f"{row.pagoda_ms / row.roofline_ms:.1f}x"
        lines.append(
            f"| {row.case} | {row.pagoda_ms:.1f} | {theirs_ms} | {row.pagoda_tokens_per_s:.0f} | "
            f"{f'{theirs_tps:.0f}' if theirs_tps is not None else 'n/a'} | {roof} | {ratio} |"
        )
    return "\n".join(lines)


def docs_section_name(kind: str) -> str:
    """The generated section of docs/benchmarks.md that `--write-docs` replaces."""
    return "make bench-worker" if kind == "cpu" else "make bench-worker --device cuda"


def write_docs(path: Path, kind: str, body: str) -> None:
    """Replace the generated worker section of `path` (appended when absent); the prose and
    headings around it stay."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    path.write_text(docs_section.replace_section(text, docs_section_name(kind), body))


def fitting_cases(
    model, batches: tuple[int, ...], contexts: tuple[int, ...], device: str
) -> list[tuple[int, int]]:
    """(batch, context) decode cases in context-major order, without those whose K/V would
    take more than half the GPU's free memory (the reference side holds its own copy)."""
    cases = [(batch, context) for context in contexts for batch in batches]
    if not device.startswith("cuda"):
        return cases
    text = model.config.get_text_config()
    num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    element_bytes = next(model.parameters()).element_size()
    bytes_per_token = 2 * text.num_hidden_layers * num_kv_heads * head_dim * element_bytes
    free_bytes, _ = torch.cuda.mem_get_info(torch.device(device))
    fitting = [(b, c) for b, c in cases if b * c * bytes_per_token <= free_bytes / 2]
    for batch, context in sorted(set(cases) - set(fitting)):
        print(f"left out: decode batch {batch}, context {context} (its K/V does not fit)")
    return fitting


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.worker_step", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="default", help="model spec, as for the worker")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="as the worker's --dtype")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "none", "int8"),
        help="as the worker's; applied to both sides (int8: the same int8 Linear layers)",
    )
    parser.add_argument(
        "--decode-batches",
        type=_ints,
        help="comma-separated (default: 1,8,32,64 on CPU, to 256 on CUDA)",
    )
    parser.add_argument(
        "--contexts",
        type=_ints,
        help="decode context tokens (default: 128 on CPU; 128,1024,4096 on CUDA)",
    )
    parser.add_argument(
        "--prefill-lengths",
        type=_ints,
        default=PREFILL_LENGTHS,
        help="comma-separated; empty: none",
    )
    parser.add_argument("--no-mixed", action="store_true", help="leave out the mixed step")
    parser.add_argument(
        "--attention-backend",
        default="auto",
        help="as the worker's (default auto: the backend the worker would pick)",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="decode steps eagerly (the worker captures graphs on CUDA by default)",
    )
    parser.add_argument(
        "--no-piecewise-graphs",
        action="store_true",
        help="steps a decode graph cannot take eagerly (the worker replays them in pieces)",
    )
    parser.add_argument(
        "--launch-ahead",
        choices=LAUNCH_AHEAD,
        default="auto",
        help="as the worker's: also time decode steps launched back to back, each before "
        "the one before it is read (auto: on CUDA)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per case (median)")
    parser.add_argument(
        "--write-docs",
        type=Path,
        help="replace the generated 'make bench-worker' ('... --device cuda') section of this file",
    )
    args = parser.parse_args(argv)

    device = pick_device(args.device)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    batches = args.decode_batches or DECODE_BATCHES[kind]
    contexts = args.contexts or DECODE_CONTEXTS[kind]
    quantization = resolve_quantization(args.quantization, device, args.dtype)
    resolved = resolve_model_dir(args.model)
    reference = load_model(resolved, device, args.dtype)
    quantize(reference, quantization)
    model = load_model(resolved, device, args.dtype)
    cases = fitting_cases(model, batches, contexts, device)
    # Enough blocks for the largest case; every case forgets its sequences after it.
    largest = max([b * c for b, c in cases] + [2 * max(PREFILL_LENGTHS)])
    largest += MIXED_DECODES * max(contexts) + MIXED_CHUNK_TOKENS
    num_kv_blocks = -(-largest // BLOCK_SIZE) + max(batches) + MIXED_DECODES + 8
    # The production path: the attention backend and CUDA graphs the worker itself picks.
    engine = PagedEngine(model, model_id=resolved.model_id, num_kv_blocks=num_kv_blocks,
                         block_size=BLOCK_SIZE, quantization=quantization,
                         attention_backend=args.attention_backend,
                         cuda_graphs=not args.no_cuda_graphs,
                         piecewise_tokens=0 if args.no_piecewise_graphs else max(
                             PIECEWISE_TOKENS, *args.prefill_lengths,
                             MIXED_CHUNK_TOKENS + MIXED_DECODES))  # fmt: skip
    if engine.decode_graphs is not None:
        engine.decode_graphs.capture()
    if engine.piecewise_graphs is not None:
        engine.piecewise_graphs.capture(CAPTURE_BUDGET_S)
    bench = Bench(engine, reference, args.repeats)
    started_s = time.monotonic()
    engine.launches_ahead = resolves_launch_ahead(args.launch_ahead, device)
    rows = [row for batch, context in cases for row in bench.decode(batch, context)]
    rows += [bench.prefill(num_tokens) for num_tokens in args.prefill_lengths]
    if not args.no_mixed:
        rows += bench.mixed(contexts[0])
    table = render_table(rows)
    machine = (
        f"{os.cpu_count()} cores {platform.machine()} CPU, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)"
        if device == "cpu"
        else torch.cuda.get_device_name()
    )
    summary = (
        f"{resolved.model_id}, {engine.facts.dtype} on {device}, quantization {quantization}, "
        f"attention {engine.attention_backend.name}, CUDA graphs "
        f"{'on' if engine.decode_graphs is not None else 'off'}, pieces "
        f"{'on' if engine.piecewise_graphs is not None else 'off'}, steps launched ahead "
        f"{'timed' if engine.launches_ahead else 'off'}; {machine}; "
        f"block size {BLOCK_SIZE}; median of {args.repeats} repeats "
        f"(fewer for long prefills); run took {time.monotonic() - started_s:.0f} s."
    )
    print(summary)
    print(table)
    if args.write_docs:
        heading = "" if kind == "cpu" else "### `make bench-worker --device cuda`\n\n"
        body = heading + (
            f"`python -m benchmarks.worker_step`, {datetime.date.today().isoformat()}: {summary}\n\n"
            "transformers = the same model's own forward with its `DynamicCache` (sdpa), "
            "same shapes, weights, dtype and quantization, same run: decode as a padded "
            "`[B, 1]` batch over a (context - 1)-token cache; "
            "prefill with `logits_to_keep=1` as `generate()` does. A mixed step feeds "
            "both the chunk and the decodes in one forward; two steps is the sum of "
            "the chunk alone and the decodes alone.\n\n"
            f"{table}\n"
        )
        write_docs(args.write_docs, kind, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
