"""N-gram speculation against decoding one token at a time: `python -m benchmarks.speculation`.

One worker and scheduler of --model on this machine; the scheduler restarted per setting of
--speculative-tokens (0: off). Two kinds of chat requests, greedy:
  - `echo`: tasks whose answer repeats the prompt (copy a list, fix a paragraph's typos,
    turn a table into JSON, rename a variable in code), where drafts are often right;
  - `open`: questions whose answer repeats nothing, where drafts are rare and wasted;
  - `json`: extraction under a JSON schema (structured output): the answer copies the
    prompt's names and numbers into a fixed shape, each constrained row drafting with a
    mask per sample point;
  - `tools`: a question for one of two tools under tool_choice "required": the answer
    is a call, whose keys and tool names the grammar forces (drafted as such).
Each kind runs one request at a time (--sequential) and as a burst of --burst at once.
Reported per setting and run: generated tokens, wall time, tokens per second, the
drafted tokens the model accepted (GetServerStats before and after), and whether every
request's tokens equal those of the first setting (they must: speculation changes how
many tokens a step computes, never which).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time

import grpc

from benchmarks.suite_service import LocalService, resolve_model_dir
from pagoda.protos import generation_pb2, generation_pb2_grpc

WORDS = [
    "river", "stone", "lantern", "harbor", "meadow", "copper", "violet", "thunder", "orchard",
    "silver", "canyon", "falcon", "ember", "willow", "granite", "saffron", "glacier", "cobalt",
    "juniper", "marble",
]  # fmt: skip


def echo_prompts(count: int) -> list[str]:
    """Tasks whose answer copies most of the prompt, each with its own items."""
    prompts = []
    for index in range(count):
        items = [f"{WORDS[(index + k) % len(WORDS)]} {WORDS[(3 * index + 2 * k) % len(WORDS)]}"
                 for k in range(8)]  # fmt: skip
        match index % 4:
            case 0:
                body = "\n".join(f"- {item}" for item in items)
                prompts.append(f"Copy this list exactly, in the same order:\n{body}")
            case 1:
                text = ". ".join(f"The {a} is near the {b}" for a, b in itertools.pairwise(items))
                prompts.append(f"Fix the spelling and return the whole text:\n{text}.")
            case 2:
                rows = "\n".join(f"{item} | {k * 7 + index}" for k, item in enumerate(items))
                prompts.append(f"Turn this table into a JSON list of objects:\n{rows}")
            case _:
                code = "\n".join(
                    f"def {item.replace(' ', '_')}(value):\n    return value * {k + 2}"
                    for k, item in enumerate(items[:5])
                )
                prompts.append(f"Rename every parameter `value` to `x` in this code:\n{code}")
    return prompts


def open_prompts(count: int) -> list[str]:
    return [
        f"Write a short story about a {WORDS[i % len(WORDS)]} and a {WORDS[(7 * i + 3) % len(WORDS)]}."
        for i in range(count)
    ]


# What the `json` kind's answers must look like.
ITEMS_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
                "required": ["name", "count"],
                "additionalProperties": False,
            },
            "maxItems": 6,  # the prompts' count: a small model would go on repeating
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def json_prompts(count: int) -> list[str]:
    """Extraction tasks: a sentence per item, answered as ITEMS_SCHEMA's JSON."""
    prompts = []
    for index in range(count):
        lines = " ".join(
            f"We counted {k * 3 + index + 2} {WORDS[(index + 5 * k) % len(WORDS)]} "
            f"{WORDS[(2 * index + k) % len(WORDS)]}s."
            for k in range(6)
        )
        prompts.append(f"List every item and its count as JSON: {lines}")
    return prompts


CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Perth", "Dakar"]


def tools_prompts(count: int) -> list[str]:
    return [
        f"What is the weather in {CITIES[i % len(CITIES)]} right now, in celsius?"
        if i % 2 == 0
        else f"Search the web for the history of {CITIES[i % len(CITIES)]}."
        for i in range(count)
    ]


TOOLS = [
    generation_pb2.Tool(
        name="get_weather",
        description="The current weather in a city",
        parameters=json.dumps(
            {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            }
        ),
    ),
    generation_pb2.Tool(
        name="web_search",
        description="Search the web",
        parameters=json.dumps(
            {
                "type": "object",
                "properties": {"query": {"type": "string", "maxLength": 80}},
                "required": ["query"],
            }
        ),
    ),
]
PROMPTS = {"echo": echo_prompts, "open": open_prompts, "json": json_prompts, "tools": tools_prompts}
# Each kind's fields of its ChatRequests beyond the message.
FIELDS = {
    "json": {"constraint": generation_pb2.Constraint(json_schema=json.dumps(ITEMS_SCHEMA))},
    "tools": {
        "tools": TOOLS,
        "tool_choice": generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_REQUIRED),
        "parallel_tool_calls": False,
    },
}


async def chat(stub, prompt: str, max_new_tokens: int, fields, sampling) -> list[int]:
    request = generation_pb2.ChatRequest(
        messages=[generation_pb2.ChatMessage(role="user", content=prompt)],
        sampling=sampling,
        stopping=generation_pb2.StoppingCriteria(max_new_tokens=max_new_tokens),
        **fields,
    )
    tokens: list[int] = []
    async for response in stub.Chat(request, timeout=900):
        tokens.extend(response.token_ids)
    return tokens


async def run(
    address: str,
    prompts: list[str],
    max_new_tokens: int,
    concurrency: int,
    fields: dict,
    sampling: generation_pb2.SamplingParams,
):
    """Every prompt's tokens, the wall time, and the drafted and accepted tokens."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        before = await stub.GetServerStats(generation_pb2.ServerStatsRequest())
        start_s = time.monotonic()
        outputs: list[list[int]] = []
        for first in range(0, len(prompts), concurrency):
            batch = prompts[first : first + concurrency]
            outputs += await asyncio.gather(
                *(chat(stub, p, max_new_tokens, fields, sampling) for p in batch)
            )
        wall_s = time.monotonic() - start_s
        after = await stub.GetServerStats(generation_pb2.ServerStatsRequest())
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
    return outputs, wall_s, drafted, accepted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speculation", description=__doc__)
    add = parser.add_argument
    add("--model", default="default", help="default, dummy or a directory")
    add("--settings", default="0,4", help="comma-separated --speculative-tokens values")
    add("--kinds", default="echo,open,json")
    add("--requests", type=int, default=8, help="requests per kind and run")
    add("--burst", type=int, default=8, help="requests at once in the burst run")
    add("--max-new-tokens", type=int, default=160)
    add("--runs", default="sequential,burst")
    add("--repetition-penalty", type=float, default=1.0, help="as the CLI's 1.1, say")
    args = parser.parse_args(argv)
    sampling = generation_pb2.SamplingParams(
        temperature=0.0, repetition_penalty=args.repetition_penalty
    )
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(PROMPTS):
        parser.error(f"unknown kinds {sorted(unknown)}: choose from {sorted(PROMPTS)}")
    prompts = {kind: PROMPTS[kind](args.requests) for kind in kinds}
    reference: dict[str, list[list[int]]] = {}
    print(f"model {args.model}, {args.requests} chat requests per kind, greedy, "
          f"repetition penalty {args.repetition_penalty:g}, "
          f"at most {args.max_new_tokens} new tokens")  # fmt: skip
    print(f"{'drafts':>6} {'kind':>5} {'run':>10} {'tokens':>7} {'wall s':>7} {'tok/s':>7} "
          f"{'accepted':>14} {'same tokens':>11}")  # fmt: skip
    with LocalService(
        worker_model=args.model, device="cpu", model_dir=resolve_model_dir(args.model)
    ) as service:
        service.start_worker()
        for setting in args.settings.split(","):
            service.use_scheduler(("--speculative-tokens", setting))
            for kind in kinds:
                for run_name in args.runs.split(","):
                    concurrency = 1 if run_name == "sequential" else args.burst
                    outputs, wall_s, drafted, accepted = asyncio.run(
                        run(
                            service.address,
                            prompts[kind],
                            args.max_new_tokens,
                            concurrency,
                            FIELDS.get(kind, {}),
                            sampling,
                        )
                    )
                    same = reference.setdefault(kind, outputs) == outputs
                    num_tokens = sum(map(len, outputs))
                    share = f"{accepted}/{drafted}" if drafted else "-"
                    print(f"{setting:>6} {kind:>5} {run_name:>10} {num_tokens:>7} {wall_s:>7.1f} "
                          f"{num_tokens / wall_s:>7.1f} {share:>14} {'yes' if same else 'NO':>11}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
