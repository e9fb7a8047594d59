"""The `pagoda` command: stream a generation, chat, inspect the server, run the load generator.

Exit status: 0 on success, 1 when the server (or the client) refused the call, 2 for usage
errors, 130 when interrupted (Ctrl-C cancels the running stream first). Errors print one line,
`pagoda: <CODE>: <sentence>`, to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from pagoda.client import bench_cli, cli_commands
from pagoda.client.cli_commands import EXIT_ERROR
from pagoda.client.connection import DEFAULT_TARGET, ConnectionSettings
from pagoda.client.errors import PagodaError
from pagoda.client.sync_client import Client

EXIT_USAGE = 2  # argparse's own status for usage errors
# A terminal user reads the text: a mild penalty stops greedy decoding of a small model from
# repeating one line until max_new_tokens (the API itself stays at 1.0, off).
CLI_REPETITION_PENALTY = 1.1
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        connection = _connection_from_args(args)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    try:
        if args.command == "bench":
            try:
                config = bench_cli.config_from_args(args, connection)
            except ValueError as exc:
                parser.error(str(exc))
            return bench_cli.run_from_args(config, args)
        with Client(
            connection.target,
            api_key=connection.api_key,
            tls_root_cert=connection.tls_root_cert,
            timeout_s=connection.timeout_s,
        ) as client:
            return cli_commands.COMMANDS[args.command](client, args)
    except PagodaError as exc:
        cli_commands.print_error(exc)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("\npagoda: CANCELLED: interrupted; the request was cancelled.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (e.g. `| head`); the stream was cancelled on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Talk to a Pagoda server.")
    _add_connection_arguments(parser, defaults=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Connection options are accepted after the command too (they override only when given).
    common = argparse.ArgumentParser(add_help=False)
    _add_connection_arguments(common, defaults=False)

    generate = commands.add_parser(
        "generate",
        parents=[common],
        help="stream the answer to one prompt to stdout",
        description="Stream the answer to one prompt. When the model has a chat template the "
        "prompt is sent as one user turn (Chat), as an instruction-tuned model expects; "
        "--raw sends it as it is (Generate) for a plain continuation.",
    )
    generate.add_argument("prompt", help='the prompt text ("-" reads it from stdin)')
    generate.add_argument(
        "--raw",
        action="store_true",
        help="continue the prompt text as it is, without the model's chat template",
    )
    _add_generation_arguments(generate)
    generate.add_argument(
        "--tools",
        type=_tools_file,
        metavar="FILE",
        help="a JSON file of tools the model may call (a list of OpenAI's "
        '{"type": "function", "function": {...}}); its calls are printed as name(arguments)',
    )
    generate.add_argument(
        "--tool-choice",
        type=_tool_choice,
        metavar="CHOICE",
        help="auto (the default with --tools), none, required, or the name of a tool to call",
    )
    generate.add_argument("--request-id", help="an id echoed by the server and in its logs")
    generate.add_argument(
        "--n",
        type=int,
        metavar="N",
        help="draw N samples of the prompt (sharing its KV), printed one after another "
        "once all are done",
    )

    chat = commands.add_parser(
        "chat",
        parents=[common],
        help="a conversation: each stdin line is a user turn (/reset, /exit)",
    )
    chat.add_argument("--system", help="a system message opening the conversation")
    _add_generation_arguments(chat)

    for name, help_text in (("info", "the served model"), ("stats", "the scheduler's counters")):
        sub = commands.add_parser(name, parents=[common], help=help_text)
        sub.add_argument("--json", action="store_true", help="print JSON instead of a table")

    tokenize = commands.add_parser(
        "tokenize", parents=[common], help="the model's token ids of a text"
    )
    tokenize.add_argument("text")
    tokenize.add_argument(
        "--special",
        action="store_true",
        help="add the model's special tokens (BOS) as Generate does",
    )
    detokenize = commands.add_parser(
        "detokenize", parents=[common], help="token ids back to the model's text"
    )
    detokenize.add_argument("token_ids", nargs="+", type=int, metavar="ID")
    detokenize.add_argument(
        "--skip-special", action="store_true", help="leave out special tokens (BOS, EOS, markers)"
    )

    bench_parser = commands.add_parser(
        "bench", parents=[common], help="the load generator (see pagoda bench --help)"
    )
    bench_cli.add_arguments(bench_parser)
    return parser


def _add_connection_arguments(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument(
        "--target",
        default=default(os.environ.get("PAGODA_TARGET", DEFAULT_TARGET)),
        help=f"server address host:port (default: $PAGODA_TARGET or {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--api-key-file", type=Path, default=default(None), help="a file holding the bearer key"
    )
    parser.add_argument(
        "--tls-root-cert", type=Path, default=default(None), help="PEM roots; turns on TLS"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=default(None), help="deadline of each call"
    )


def _add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--max-new-tokens", type=int, help="upper bound on generated tokens")
    add("--min-new-tokens", type=int)
    add("--temperature", type=float, help="0 is greedy (the default)")
    add("--top-p", type=float)
    add("--top-k", type=int)
    add("--min-p", type=float)
    add(
        "--repetition-penalty",
        type=float,
        default=CLI_REPETITION_PENALTY,
        help=f"penalize tokens already in the text (default here {CLI_REPETITION_PENALTY}, "
        "which keeps small models from looping; 1.0 is off, the API's own default)",
    )
    add("--presence-penalty", type=float)
    add("--frequency-penalty", type=float)
    add("--seed", type=int)
    add("--stop", action="append", metavar="TEXT", help="a stop string (repeatable)")
    add("--stop-token-id", action="append", type=int, dest="stop_token_ids", metavar="ID")
    add("--ignore-eos", action="store_true", default=None)
    add("--allowed-token-ids", type=_token_ids, metavar="ID,ID,...", help="sample only these ids")
    add("--banned-token-ids", type=_token_ids, metavar="ID,ID,...", help="never sample these ids")
    add("--priority", type=int, help="lower runs first under --admission-policy priority")
    add(
        "--cache-salt",
        metavar="TEXT",
        help="share cached prompt blocks only with requests of the same salt (tenant isolation)",
    )
    add(
        "--chat-template-kwargs",
        type=_json_object,
        metavar="JSON",
        help="extra variables for the model's chat template, a JSON object, e.g. "
        "'{\"enable_thinking\": false}' to make Qwen3 answer without thinking",
    )
    add("--logprobs", type=int, metavar="N", help="print top-N logprobs per token to stderr")
    add("--show-usage", action="store_true", help="print usage and timings to stderr")


def _tools_file(path: str) -> list[Any]:
    """The tools in a JSON file: a list of them (or one)."""
    try:
        tools = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read tools from {path}: {exc}") from None
    return tools if isinstance(tools, list) else [tools]


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _tool_choice(text: str) -> str | dict[str, str]:
    return text if text in ("auto", "none", "required") else {"name": text}


def _token_ids(text: str) -> list[int]:
    """A comma-separated list of token ids, e.g. "1,2,3"."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids like 1,2,3, got {text!r}") from None


def _connection_from_args(args: argparse.Namespace) -> ConnectionSettings:
    api_key = None
    if args.api_key_file is not None:
        try:
            api_key = args.api_key_file.read_text().strip()
        except OSError as exc:
            raise OSError(
                f"cannot read --api-key-file {args.api_key_file}: {exc.strerror}"
            ) from None
    tls_root_cert = None
    if args.tls_root_cert is not None:
        try:
            tls_root_cert = args.tls_root_cert.read_bytes()
        except OSError as exc:
            raise OSError(
                f"cannot read --tls-root-cert {args.tls_root_cert}: {exc.strerror}"
            ) from None
    if args.timeout_s is not None and args.timeout_s <= 0:
        raise ValueError(f"--timeout-s must be positive, got {args.timeout_s}")
    return ConnectionSettings(args.target, api_key, tls_root_cert, args.timeout_s)
