"""The int8 forward against float32 on the same model: quality, then speed.

  .venv/bin/python -m benchmarks.quantization [--check quality|speed|all] [--model default]
      [--num-prompts 64] [--num-new-tokens 48] [--rounds 5] [--batches 1,8,32,64]
      [--variants fp32,...] [--no-peer] [--peer-threads N]

Quality: greedy agreement over the chat prompts in benchmarks/data/quantization_prompts.txt,
all prefilled in one step and decoded together through the paged engine (how the worker
serves them; every shipped path is batch-invariant, so batch mates do not matter), and
the perplexity and teacher-forced top-1 of benchmarks/data/perplexity_text.txt in one
plain forward. When llama-server is built (`make llama-server`), its greedy tokens for the
same token-id prompts on the same Q4_1 weights are compared too (`--no-peer`: skipped).

Speed: paged engine steps (benchmarks.worker_step's plans) at decode batch 1/8/32/64 over
128-token contexts and a 512-token prefill; the variants alternate inside every round so
background load hits them alike; medians and ranges over the rounds. A benchmark: nothing
here asserts a timing.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagoda.gpu_worker.model_loader import load_model, resolve_model_dir
from pagoda.gpu_worker.paged_engine import PagedEngine
from pagoda.gpu_worker.quantization import quantize_int8
from pagoda.protos import step_pb2

DATA_DIR = Path(__file__).parent / "data"
PROMPTS_FILE = DATA_DIR / "quantization_prompts.txt"
TEXT_FILE = DATA_DIR / "perplexity_text.txt"
BLOCK_SIZE = 16
DECODE_BATCHES = (1, 8, 32, 64)
PREFILL_TOKENS = 512
CONTEXT = 128  # decode steps' context, tokens


def chat_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    lines = [line for line in PROMPTS_FILE.read_text().splitlines() if line.strip()]
    return [
        _token_ids(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": line}], add_generation_prompt=True, tokenize=True
            )
        )
        for line in lines[:num_prompts]
    ]


def _token_ids(encoded) -> list[int]:
    # apply_chat_template(tokenize=True) returns ids or a BatchEncoding, by version.
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def run_step(engine: PagedEngine, plan: step_pb2.StepPlan) -> step_pb2.StepResult:
    """One wire plan through the engine, as the worker's server runs it."""
    try:
        from pagoda.common import step_codec
    except ImportError:  # an engine that takes the wire messages itself
        return engine.step(plan)
    return step_codec.encode_result(engine.step(step_codec.decode_plan(plan)))


def greedy_batch(engine: PagedEngine, prompts: list[list[int]], num_new_tokens: int):
    """Greedy tokens of every prompt: one step prefills them all, then each step decodes
    them all (no EOS stop), through hand-built plans."""
    plan = step_pb2.StepPlan(step_id=1)
    plan.token_offsets.append(0)
    plan.block_offsets.append(0)
    next_block = 0
    for seq_id, prompt in enumerate(prompts):
        num_blocks = -(-(len(prompt) + num_new_tokens) // BLOCK_SIZE)
        plan.new_sequences.add(
            seq_id=seq_id,
            num_prompt_tokens=len(prompt),
            sampling=step_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0),
        )
        plan.seq_ids.append(seq_id)
        plan.start_positions.append(0)
        plan.sample.append(True)
        plan.token_ids.extend(prompt)
        plan.token_offsets.append(len(plan.token_ids))
        plan.block_ids.extend(range(next_block, next_block + num_blocks))
        plan.block_offsets.append(len(plan.block_ids))
        next_block += num_blocks
    generated: list[list[int]] = [[] for _ in prompts]
    for step in range(num_new_tokens):
        result = run_step(engine, plan)
        if result.step_error or result.errors:
            raise RuntimeError(f"step failed: {result.step_error or result.errors}")
        for seq_id, token_id in zip(result.seq_ids, result.token_ids, strict=True):
            generated[seq_id].append(token_id)
        plan = step_pb2.StepPlan(step_id=step + 2)
        plan.token_offsets.append(0)
        plan.block_offsets.append(0)
        for seq_id, prompt in enumerate(prompts):
            plan.seq_ids.append(seq_id)
            plan.start_positions.append(len(prompt) + step)
            plan.sample.append(True)
            plan.token_ids.append(generated[seq_id][-1])
            plan.token_offsets.append(len(plan.token_ids))
            plan.block_offsets.append(0)
    engine.reset()
    return generated


@dataclass(frozen=True, slots=True)
class Agreement:
    num_prompts: int
    num_identical: int
    mean_first_divergence: float  # over all prompts; an identical one counts as its length
    token_match_fraction: float  # position-wise equal tokens over all positions

    @property
    def identical_fraction(self) -> float:
        return self.num_identical / self.num_prompts


def agreement(reference: list[list[int]], candidate: list[list[int]]) -> Agreement:
    divergences, matches, total = [], 0, 0
    for ref, cand in zip(reference, candidate, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref, cand, strict=True)) if a != b), None)
        divergences.append(len(ref) if first is None else first)
        matches += sum(a == b for a, b in zip(ref, cand, strict=True))
        total += len(ref)
    return Agreement(
        num_prompts=len(reference),
        num_identical=sum(d == len(r) for d, r in zip(divergences, reference, strict=True)),
        mean_first_divergence=statistics.fmean(divergences),
        token_match_fraction=matches / total,
    )


@dataclass(frozen=True, slots=True)
class TextScores:
    perplexity: float  # exp(mean next-token loss)
    predicted_ids: list[int]  # the argmax next token at every position (teacher-forced)


@torch.inference_mode()
def score_text(model, token_ids: list[int]) -> TextScores:
    """One forward over the text (stock attention): its perplexity, and the model's top
    next-token guess at each position given the true prefix."""
    input_ids = torch.tensor([token_ids])
    output = model(input_ids=input_ids, labels=input_ids)
    return TextScores(math.exp(output.loss.item()), output.logits[0].argmax(-1).tolist())


def top1_agreement(reference: TextScores, candidate: TextScores) -> float:
    pairs = list(zip(reference.predicted_ids, candidate.predicted_ids, strict=True))
    return sum(a == b for a, b in pairs) / len(pairs)


def text_token_ids(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT_FILE.read_text())


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    prepare: Callable[[object], object]  # a float32 model -> the model to run


def plain_quantize_dynamic(model):
    """torch.ao's quantize_dynamic, per-channel weights, the head left float: the
    baseline the worker's Int8Linear improves on (one activation scale per call)."""
    import warnings

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    head = model.get_output_embeddings()
    names = {
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, dict.fromkeys(names, per_channel_dynamic_qconfig))


def on_int4pack(model):
    """The shipped int8 path as on a CPU where Pagoda's Q4_1 kernel cannot run: Q4_1
    layers on PyTorch's int4 GEMM, bfloat16 activations."""
    from unittest import mock

    from pagoda.gpu_worker import cpu_kernels

    with mock.patch.object(cpu_kernels, "load", lambda cache_dir=None: None):
        return quantize_int8(model, head="rescored")


def on_float_rows(model):
    """The shipped int8 path as on a CPU without AVX-512 VNNI: the head's first pass takes
    float32 activations (gemm.c) instead of int8 rows and int32 sums (int8_dot.c)."""
    from pagoda.gpu_worker import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        return quantize_int8(model, head="rescored")
    integer, kernels.int8_dot = kernels.int8_dot, False
    try:
        return quantize_int8(model, head="rescored")
    finally:
        kernels.int8_dot = integer


VARIANTS = {
    "fp32": Variant("fp32", lambda model: model),
    "quantize_dynamic": Variant("quantize_dynamic", plain_quantize_dynamic),
    "int8-unsmoothed": Variant(
        "int8-unsmoothed", lambda model: quantize_int8(model, head="float32", smooth=False)
    ),
    "int8": Variant("int8", lambda model: quantize_int8(model, head="float32")),
    "int8+head": Variant("int8+head", lambda model: quantize_int8(model, head="int8")),
    "int8+rescored-head": Variant(
        "int8+rescored-head", lambda model: quantize_int8(model, head="rescored")
    ),
    "int8+rescored-head+int4pack": Variant("int8+rescored-head+int4pack", on_int4pack),
    "int8+rescored-head+float-rows": Variant("int8+rescored-head+float-rows", on_float_rows),
    "int8-per-token+rescored-head": Variant(
        "int8-per-token+rescored-head",
        lambda model: quantize_int8(model, head="rescored", q4=False),
    ),
    "int8+rescored-head+float-down": Variant(
        "int8+rescored-head+float-down",
        lambda model: quantize_int8(model, head="rescored", keep_float=("down_proj",)),
    ),
    "int8+rescored-head-unsmoothed": Variant(
        "int8+rescored-head-unsmoothed",
        lambda model: quantize_int8(model, head="rescored", smooth=False),
    ),
}


def llama_server_greedy(
    prompts: list[list[int]], num_new_tokens: int, threads: int | None = None
) -> list[list[int]] | str:
    """llama.cpp's greedy tokens for the same token-id prompts on the same Q4_1 weights
    (one slot, `ignore_eos`, temperature 0, no prompt cache), or the line saying why the
    peer was skipped (the binary is built by `make llama-server`)."""
    import http.client
    import json

    from benchmarks import llama_server as peer
    from benchmarks.suite_service import free_port

    install = peer.installation()
    if (reason := peer.skip_reason(install, "cpu")) is not None:
        return reason
    port = free_port()
    argv = peer.server_argv(
        install.binary,
        install.model,
        port,
        parallel=1,
        context_per_slot=peer.context_per_slot(prompts, num_new_tokens),
        threads=threads or os.cpu_count() or 1,
    )
    generated = []
    with peer.LlamaServer(argv, port) as server:
        server.start()
        for prompt in prompts:
            body = {
                "prompt": prompt,
                "n_predict": num_new_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "cache_prompt": False,
                "return_tokens": True,
            }
            connection = http.client.HTTPConnection(peer.HOST, port, timeout=120)
            try:
                connection.request(
                    "POST", "/completion", json.dumps(body), {"Content-Type": "application/json"}
                )
                answer = json.loads(connection.getresponse().read())
            finally:
                connection.close()
            generated.append(list(answer["tokens"])[:num_new_tokens])
    return generated


def quality(
    resolved,
    variants: list[Variant],
    num_prompts: int,
    num_new_tokens: int,
    with_peer: bool = True,
    peer_threads: int | None = None,
) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    prompts = chat_prompts(tokenizer, num_prompts)
    text_ids = text_token_ids(tokenizer)
    greedy: dict[str, list[list[int]]] = {}
    scores: dict[str, TextScores] = {}
    for variant in variants:
        model = variant.prepare(load_model(resolved, "cpu"))
        scores[variant.name] = score_text(model, text_ids)
        num_blocks = sum(-(-(len(p) + num_new_tokens) // BLOCK_SIZE) for p in prompts)
        engine = PagedEngine(
            model,
            model_id=resolved.model_id,
            num_kv_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            attention_backend="auto",  # the worker's
        )
        greedy[variant.name] = greedy_batch(engine, prompts, num_new_tokens)
        del engine, model
        print(f"  {variant.name}: perplexity {scores[variant.name].perplexity:.3f}", flush=True)
    base = variants[0].name
    peer = (
        llama_server_greedy(prompts, num_new_tokens, peer_threads)
        if with_peer
        else "llama-server not asked for"
    )
    if isinstance(peer, str):
        print(f"  {peer}: no greedy comparison with llama.cpp", flush=True)
    lines = [
        f"{len(prompts)} chat prompts ({min(map(len, prompts))}-{max(map(len, prompts))} "
        f"tokens), {num_new_tokens} greedy tokens each, one batch; perplexity over "
        f"{len(text_ids)} tokens of {TEXT_FILE.name}.",
        "",
        "| variant | prompts identical to fp32 | mean first divergence (of "
        f"{num_new_tokens}) | tokens equal by position | perplexity | vs fp32 "
        "| next-token top-1 = fp32's |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for variant in variants:
        agree = agreement(greedy[base], greedy[variant.name])
        score = scores[variant.name]
        delta = score.perplexity / scores[base].perplexity - 1
        lines.append(
            f"| {variant.name} | {agree.num_identical}/{agree.num_prompts} "
            f"({agree.identical_fraction:.0%}) | {agree.mean_first_divergence:.1f} | "
            f"{agree.token_match_fraction:.1%} | {score.perplexity:.3f} | {delta:+.2%} | "
            f"{top1_agreement(scores[base], score):.1%} |"
        )
    if not isinstance(peer, str):
        agree = agreement(greedy[base], peer)
        lines.append(
            f"| llama-server (Q4_1 x Q8_1 blocks) | {agree.num_identical}/{agree.num_prompts} "
            f"({agree.identical_fraction:.0%}) | {agree.mean_first_divergence:.1f} | "
            f"{agree.token_match_fraction:.1%} | - | - | - |"
        )
    shipped = "int8+rescored-head"
    if shipped in scores:
        delta = scores[shipped].perplexity / scores[base].perplexity - 1
        top1 = top1_agreement(scores[base], scores[shipped])
        divergence = agreement(greedy[base], greedy[shipped]).mean_first_divergence
        peer_divergence = None if isinstance(peer, str) else agreement(greedy[base], peer)
        lines += [
            "",
            f"Issue 26's targets for {shipped} (the default): perplexity within 1% of fp32: "
            f"{'pass' if abs(delta) < 0.01 else 'FAIL'} ({delta:+.2%}); teacher-forced top-1 >= 97%: "
            f"{'pass' if top1 >= 0.97 else 'FAIL'} ({top1:.1%}); mean first divergence >= "
            + (
                "llama-server's: not compared (no binary)"
                if peer_divergence is None
                else f"llama-server's {peer_divergence.mean_first_divergence:.1f}: "
                f"{'pass' if divergence >= peer_divergence.mean_first_divergence else 'FAIL'}"
            )
            + f" ({divergence:.1f}).",
        ]
    return "\n".join(lines)


def speed(
    resolved, variants: list[Variant], rounds: int, batches: tuple[int, ...] = DECODE_BATCHES
) -> str:
    from benchmarks.worker_step import Bench

    benches = {}
    for variant in variants:
        model = variant.prepare(load_model(resolved, "cpu"))
        engine = PagedEngine(
            model,
            model_id=resolved.model_id,
            num_kv_blocks=1100,
            block_size=BLOCK_SIZE,
            attention_backend="auto",  # the worker's
        )
        benches[variant.name] = Bench(engine, None, rounds)
    cases: list[tuple[str, dict[str, Callable[[], object]]]] = []
    for batch in batches:
        steps = {}
        for name, bench in benches.items():
            plan = bench.decode_plan(bench.decode_sequences(batch, CONTEXT), CONTEXT)
            steps[name] = lambda bench=bench, plan=plan: bench._step(plan)
        cases.append((f"decode, batch {batch}, context {CONTEXT}", steps))
    steps = {}
    for name, bench in benches.items():
        seq_id, first = bench.prefill_plan(PREFILL_TOKENS)
        bench._step(first)
        _, again = bench.prefill_plan(PREFILL_TOKENS, seq_id)  # rewinds to position 0
        steps[name] = lambda bench=bench, plan=again: bench._step(plan)
    cases.append((f"prefill, {PREFILL_TOKENS} tokens", steps))

    names = [v.name for v in variants]
    header = " | ".join(f"{n} ms (range)" for n in names)
    ratios = " | ".join(f"{n} / {names[0]}" for n in names[1:])
    lines = [f"| step | {header} | {ratios} |", "|---" + "|---:" * (2 * len(names) - 1) + "|"]
    for label, steps in cases:
        for run in steps.values():  # warm-up
            run()
        samples: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(rounds):
            for name in names:  # alternated within each round
                started_s = time.perf_counter()
                steps[name]()
                samples[name].append((time.perf_counter() - started_s) * 1e3)
        medians = {name: statistics.median(s) for name, s in samples.items()}
        cells = " | ".join(
            f"{medians[n]:.1f} ({min(samples[n]):.0f}-{max(samples[n]):.0f})" for n in names
        )
        ratio_cells = " | ".join(f"{medians[n] / medians[names[0]]:.2f}" for n in names[1:])
        lines.append(f"| {label} | {cells} | {ratio_cells} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.quantization", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--check", choices=("quality", "speed", "all"), default="all")
    parser.add_argument("--model", default="default", help="model spec, as for the worker")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per speed case")
    parser.add_argument(
        "--no-peer",
        dest="peer",
        action="store_false",
        help="skip llama-server's greedy tokens in the quality check",
    )
    parser.add_argument(
        "--peer-threads",
        type=int,
        default=None,
        help="llama-server's threads (default: every core; 1 on a loaded machine)",
    )
    parser.add_argument(
        "--batches",
        default=",".join(map(str, DECODE_BATCHES)),
        help="decode batch sizes of the speed check",
    )
    parser.add_argument(
        "--variants",
        default="fp32,int8+rescored-head,int8+rescored-head+float-down",
        help=f"from {', '.join(VARIANTS)}; fp32 first",
    )
    args = parser.parse_args(argv)
    variants = [VARIANTS[name] for name in args.variants.split(",")]
    resolved = resolve_model_dir(args.model)
    print(
        f"{resolved.model_id} on {os.cpu_count()} cores {platform.machine()}, torch "
        f"{torch.__version__} ({torch.get_num_threads()} threads, quantized engine "
        f"{torch.backends.quantized.engine})",
        flush=True,
    )
    if args.check in ("quality", "all"):
        started_s = time.monotonic()
        print(
            quality(
                resolved,
                variants,
                args.num_prompts,
                args.num_new_tokens,
                args.peer,
                args.peer_threads,
            )
        )
        print(f"(quality took {time.monotonic() - started_s:.0f} s)", flush=True)
    if args.check in ("speed", "all"):
        batches = tuple(int(b) for b in args.batches.split(","))
        print(speed(resolved, variants, args.rounds, batches))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
