"""The scheduler's structured-output cost per step: fill_masks for N constrained rows of the
default model's vocabulary (49,152 tokens), each matcher at a different point of a JSON
object, consuming one token per step as in serving. `python -m benchmarks.grammar_masks
[--rows 64] [--repeats 50] [--drafts 4] [--kind tool-calls]`; prints the median and p90
milliseconds per step (masks computed, packed and attached to the plan). With --drafts, each
row also drafts the object's next tokens (speculation): a mask per sample point, the matcher
fed the drafts and rolled back. `--kind tool-calls`: instead of a JSON object, tool_choice
AUTO's lazy grammar with a strict tool, the rows at points of a text and then a call."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagoda.gpu_worker.model_loader import resolve_model_dir
from pagoda.scheduler_svc.core import StepPlan
from pagoda.scheduler_svc.core.request import Request, token_array
from pagoda.scheduler_svc.grammar_masks import fill_masks
from pagoda.scheduler_svc.grammars import GrammarCompiler, ValidConstraint
from pagoda.scheduler_svc.tokenizer import load_tokenizer
from pagoda.scheduler_svc.tool_constraints import tool_constraint
from pagoda.scheduler_svc.tools import ToolFormat, valid_tools

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
TEXT = '{"name":"Ann Smith","age":31,"tags":["calm","kind","tall"]}'
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL_CALL_TEXT = (
    "Let me look up the weather there for you, it only takes a moment.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def constraint_and_text(
    kind: str, added_tokens: tuple[tuple[str, int], ...]
) -> tuple[ValidConstraint, str]:
    if kind == "json":
        return ValidConstraint("json_schema", json.dumps(SCHEMA)), TEXT
    tools = valid_tools(
        [("get_weather", "", json.dumps(CITY), True), ("get_time", "", "", False)],
        "auto", "", True, ToolFormat.GENERIC, (), added_tokens,
    )  # fmt: skip
    assert tools is not None and tools.holds_auto_calls
    return tool_constraint(tools), TOOL_CALL_TEXT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--drafts", type=int, default=0, help="drafts per row (0: none)")
    parser.add_argument("--kind", choices=("json", "tool-calls"), default="json")
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model_dir("default").path)
    vocab_size = tokenizer.vocab_size
    eos = sorted(tokenizer.eos_token_ids)
    compiler = GrammarCompiler(tokenizer.tokenizer.to_str)
    constraint, text = constraint_and_text(args.kind, tokenizer.added_tokens)
    text_ids = tokenizer.encode(text, add_special_tokens=False)
    started = time.perf_counter()
    requests = {}
    for row in range(args.rows):
        generated = text_ids[: row % len(text_ids)]
        requests[row] = Request(
            request_id=f"r{row}", sampling=None, stopping=None, priority=0,
            num_prompt_tokens=1, token_ids=token_array([1, *generated]), arrival_s=0.0,
            grammar=compiler.compile(constraint, vocab_size, eos),
        )  # fmt: skip
    compile_ms = (time.perf_counter() - started) * 1e3
    plan = StepPlan(step_id=0, seq_ids=list(requests), sample=[True] * args.rows)
    if args.drafts:  # each row: its last token, then the object's next tokens as drafts
        for row in range(args.rows):
            done = row % len(text_ids)
            drafts = text_ids[done : done + args.drafts]
            plan.token_ids += [text_ids[done - 1] if done else 1, *drafts]
            plan.token_offsets.append(len(plan.token_ids))
            plan.draft_counts.append(len(drafts))
    fill_masks(plan, requests.get, vocab_size)  # the matchers consume their tokens here
    times_ms = []
    for _ in range(args.repeats):
        # One token back, so each step consumes a token and computes a fresh mask, as in
        # serving (a matcher may keep the mask of a state it has not left).
        for request in requests.values():
            grammar = request.grammar
            if grammar.num_consumed_tokens:
                grammar.matcher.rollback(1)
                grammar.num_consumed_tokens -= 1
        started = time.perf_counter()
        fill_masks(plan, requests.get, vocab_size)
        times_ms.append((time.perf_counter() - started) * 1e3)
    times_ms.sort()
    print(
        f"{args.rows} constrained rows ({args.kind}), {sum(plan.draft_counts)} drafts, vocabulary "
        f"{vocab_size}: fill_masks median "
        f"{statistics.median(times_ms):.2f} ms, p90 {times_ms[int(0.9 * len(times_ms))]:.2f} ms "
        f"({len(plan.allowed_token_bitmask)} bytes of masks); first compile of {args.rows} "
        f"(vocabulary read included) {compile_ms:.0f} ms"
    )


if __name__ == "__main__":
    main()
