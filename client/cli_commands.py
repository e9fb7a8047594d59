"""The `pagoda` commands that talk to one server: generate, chat, info, stats, tokenize,
detokenize.

Each takes the open Client and the parsed arguments and returns the exit status; server
refusals propagate as PagodaError (except inside chat, which reports them and goes on).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from pagoda.client.convert import GenerationOptions
from pagoda.client.errors import PagodaError
from pagoda.client.results import Chunk, Completion, join_chunks, join_samples
from pagoda.client.sync_client import ChunkStream, Client

EXIT_ERROR = 1

# The CLI flags that become generation options share their names with the converter's.
OPTION_NAMES = tuple(GenerationOptions.__annotations__)


def generation_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line; the rest stay at the server's defaults."""
    values = {name: getattr(args, name, None) for name in OPTION_NAMES}
    return {name: value for name, value in values.items() if value is not None}


def chat_options(args: argparse.Namespace) -> dict[str, Any]:
    """generation_options, and with tools one sample's calls streamed as they are written."""
    options = generation_options(args)
    if options.get("tools") and options.get("n", 1) == 1:
        options["stream_tool_calls"] = True
    return options


def run_generate(client: Client, args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    started = time.perf_counter()
    # An instruction-tuned model answers a turn of its own chat format, and merely continues
    # raw text (ollama's generate makes the same choice; --raw is its escape hatch too).
    if args.raw or not client.model_info().has_chat_template:
        stream = client.generate(prompt, **generation_options(args))
    else:
        stream = client.chat([{"role": "user", "content": prompt}], **chat_options(args))
    with stream:
        if (args.n or 1) > 1:
            return _print_samples(join_samples(stream), args, started)
        completion, first_token_s, num_calls = _stream_to_stdout(stream)
    _finish_answer(completion, args, started, first_token_s, num_calls)
    return 0


def _print_samples(completions: list[Completion], args: argparse.Namespace, started: float) -> int:
    """n samples, each under a header line, with its own usage when asked."""
    for completion in completions:
        sys.stdout.write(f"--- sample {completion.index} ---\n{completion.text}")
        _finish_answer(completion, args, started, None)
    return 0


def run_chat(client: Client, args: argparse.Namespace) -> int:
    opening = [{"role": "system", "content": args.system}] if args.system else []
    history = list(opening)
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())
    failed = False
    for line in _user_lines(interactive):
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = list(opening)
            print("pagoda: conversation reset", file=sys.stderr)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        started = time.perf_counter()
        try:
            with client.chat(history, **chat_options(args)) as stream:
                completion, first_token_s, num_calls = _stream_to_stdout(stream)
        except PagodaError as exc:
            history.pop()
            print_error(exc)
            failed = True
            continue
        history.append({"role": "assistant", "content": completion.text})
        _finish_answer(completion, args, started, first_token_s, num_calls)
    return EXIT_ERROR if failed else 0


def _user_lines(interactive: bool) -> Iterator[str]:
    """The user's turns, stripped; ends at end of input."""
    if not interactive:
        for line in sys.stdin:
            yield line.strip()
        return
    print("pagoda chat: one line per turn; /reset starts over, /exit leaves.", file=sys.stderr)
    while True:
        try:
            yield input("> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return


def _stream_to_stdout(stream: ChunkStream) -> tuple[Completion, float | None, int]:
    """Write each chunk's text (and calls, when they stream) as it arrives; the joined
    completion, first-token time and number of calls written.

    A thinking model's reasoning goes to stderr between <think> and </think> lines as it
    arrives, so stdout holds the answer alone (all reasoning comes before the answer).
    """
    chunks = []
    first_token_s = None
    answer = _Answer()
    reasoning = ""  # written to stderr, its </think> line not yet
    try:
        for chunk in stream:
            if first_token_s is None and chunk.token_ids:
                first_token_s = time.perf_counter()
            if chunk.reasoning_text:
                if not reasoning:
                    sys.stderr.write("<think>\n")
                reasoning += chunk.reasoning_text
                sys.stderr.write(chunk.reasoning_text)
                sys.stderr.flush()
            if reasoning and (chunk.text or chunk.tool_call_deltas or chunk.is_last):
                _end_reasoning(reasoning)
                reasoning = ""
            answer.write(chunk)
            chunks.append(chunk)
    except PagodaError:
        if reasoning:
            _end_reasoning(reasoning)
        # End the partial answer's line before the error line goes to stderr.
        answer.end_line()
        raise
    answer.end_call()
    if answer.num_calls:  # a line of text after the calls ends here
        answer.end_line()
    return join_chunks(chunks), first_token_s, answer.num_calls


class _Answer:
    """The answer on stdout as it streams: its text, and each call that streams
    (stream_tool_calls) as `name(arguments)` on a line of its own, written as it comes."""

    def __init__(self) -> None:
        self.at_line_start = True
        self.in_call = False
        self.num_calls = 0

    def write(self, chunk: Chunk) -> None:
        """A chunk's parts in the order written: more of the call open now, the text,
        the calls the chunk begins."""
        for delta in chunk.tool_call_deltas:
            if not delta.id:
                self._out(delta.arguments)
        if chunk.text:
            self.end_call()
            self._out(chunk.text)
        for delta in chunk.tool_call_deltas:
            if delta.id:
                self.end_call()
                self.end_line()
                self._out(f"{delta.name}({delta.arguments}")
                self.in_call = True
                self.num_calls += 1
        sys.stdout.flush()

    def end_call(self) -> None:
        if self.in_call:
            self._out(")\n")
            self.in_call = False

    def end_line(self) -> None:
        if not self.at_line_start:
            self._out("\n")
            sys.stdout.flush()

    def _out(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            self.at_line_start = text.endswith("\n")


def _end_reasoning(reasoning: str) -> None:
    """Close the reasoning written to stderr with its </think> line."""
    sys.stderr.write(("" if reasoning.endswith("\n") else "\n") + "</think>\n")
    sys.stderr.flush()


def _finish_answer(
    completion: Completion,
    args: argparse.Namespace,
    started: float,
    first_token_s: float | None,
    num_calls_shown: int = 0,
) -> None:
    """The answer's end: its calls but the first `num_calls_shown` (they streamed, each on
    a line of its own), then what else was asked for."""
    calls = completion.tool_calls[num_calls_shown:]
    if (
        not num_calls_shown
        and not completion.text.endswith("\n")
        and (completion.text or not calls)
    ):
        sys.stdout.write("\n")
    for call in calls:
        sys.stdout.write(f"{call.name}({call.arguments})\n")
    sys.stdout.flush()
    if completion.logprobs:
        _print_logprobs(completion)
    if args.show_usage:
        _print_usage(completion, started, first_token_s)


def _print_usage(completion: Completion, started: float, first_token_s: float | None) -> None:
    elapsed_s = time.perf_counter() - started
    parts = [f"finish: {completion.finish_reason or 'none'}"]
    usage = completion.usage
    if usage is not None:
        parts.append(
            f"tokens: prompt {usage.prompt_tokens} ({usage.cached_prompt_tokens} cached), "
            f"completion {usage.completion_tokens}"
            + (f", preempted {usage.num_preemptions}x" if usage.num_preemptions else "")
        )
    timings = completion.timings
    if timings is not None:
        parts.append(
            f"server: queued {timings.queued_ms:.1f} ms, first token {timings.first_token_ms:.1f} ms, "
            f"total {timings.total_ms:.1f} ms"
        )
    client_part = f"client: total {elapsed_s * 1000:.1f} ms"
    if first_token_s is not None:
        client_part += f", first token {(first_token_s - started) * 1000:.1f} ms"
    num_tokens = len(completion.token_ids)
    if first_token_s is not None and num_tokens > 1 and elapsed_s > first_token_s - started:
        rate = (num_tokens - 1) / (elapsed_s - (first_token_s - started))
        client_part += f", {rate:.1f} tokens/s after the first"
    parts.append(client_part)
    print("\n".join(parts), file=sys.stderr)


def _print_logprobs(completion: Completion) -> None:
    print("token_id  logprob  top alternatives (id:logprob)", file=sys.stderr)
    for entry in completion.logprobs or []:
        alternatives = " ".join(
            f"{token_id}:{logprob:.3f}"
            for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs, strict=False)
        )
        print(f"{entry.token_id:>8}  {entry.logprob:>7.3f}  {alternatives}", file=sys.stderr)


def run_info(client: Client, args: argparse.Namespace) -> int:
    _print_record(client.model_info(), args.json)
    return 0


def run_stats(client: Client, args: argparse.Namespace) -> int:
    _print_record(client.server_stats(), args.json)
    return 0


def run_tokenize(client: Client, args: argparse.Namespace) -> int:
    """The ids of TEXT on stdout, separated by spaces (as `pagoda detokenize` takes them),
    their count on stderr."""
    token_ids = client.tokenize(args.text, add_special_tokens=args.special)
    print(" ".join(map(str, token_ids)))
    print(f"{len(token_ids)} tokens", file=sys.stderr)
    return 0


def run_detokenize(client: Client, args: argparse.Namespace) -> int:
    print(client.detokenize(args.token_ids, skip_special_tokens=args.skip_special))
    return 0


def _print_record(record: Any, as_json: bool) -> None:
    values = dataclasses.asdict(record)
    if as_json:
        print(json.dumps(values, indent=2))
        return
    width = max(len(name) for name in values)
    for name, value in values.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            # ServerStats.workers and .tenants: one indented line each, its fields inline.
            print(name)
            for item in value:
                print("  " + "  ".join(f"{k}={_cell(v)}" for k, v in item.items()))
            continue
        print(f"{name.ljust(width)}  {_cell(value)}")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_cell(item) for item in value) or "-"
    return str(value)


def print_error(exc: PagodaError) -> None:
    sentence = " ".join(exc.details.split())
    print(f"pagoda: {exc.code.name}: {sentence}", file=sys.stderr)


COMMANDS = {
    "generate": run_generate,
    "chat": run_chat,
    "info": run_info,
    "stats": run_stats,
    "tokenize": run_tokenize,
    "detokenize": run_detokenize,
}
