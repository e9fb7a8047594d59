"""`pagoda bench`: the load generator's command-line options, and printing its report."""

from __future__ import annotations

import argparse
import json
import sys

from pagoda.client.bench import run_bench
from pagoda.client.bench_config import ARRIVALS, BenchConfig
from pagoda.client.bench_report import format_report_table
from pagoda.client.connection import ConnectionSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `pagoda bench` options (connection options come from the CLI)."""
    defaults = BenchConfig()
    add = parser.add_argument
    add("--num-requests", type=int, default=defaults.num_requests, help="requests to send")
    add(
        "--duration-s",
        type=float,
        default=defaults.duration_s,
        help="hard cap on the run; requests still running then are cancelled",
    )
    add(
        "--arrival",
        choices=ARRIVALS,
        default=defaults.arrival,
        help="burst: all at once; interval: every --interval-ms; poisson: --rate per second; "
        "closed: --users closed-loop users",
    )
    add("--interval-ms", type=float, default=defaults.interval_ms)
    add("--rate", type=float, default=defaults.rate_per_s, help="poisson arrivals per second")
    add("--users", type=int, default=defaults.num_users, help="closed-loop users")
    add("--seed", type=int, default=defaults.seed, help="poisson gaps and sampling seeds")
    add(
        "--prompt-repeats",
        type=_repeat_counts,
        default=defaults.prompt_repeats,
        help="comma-separated filler counts cycled over requests (1 repeat ~ 1 token), "
        "e.g. 512,1,1,1",
    )
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument(
        "--unique-prompts",
        action="store_true",
        help="a unique leading tag per prompt (the default)",
    )
    prompts.add_argument(
        "--shared-prefix", metavar="TEXT", help="a common prefix before each unique tag"
    )
    prompts.add_argument(
        "--same-prompt", action="store_true", help="identical prompts (for equal repeat counts)"
    )
    add("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    add("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    add("--temperature", type=float, default=defaults.temperature)
    add("--slo-ttft-ms", type=float, help="goodput SLO on time to first token")
    add("--slo-itl-ms", type=float, help="goodput SLO on each request's worst inter-token latency")
    add("--json", action="store_true", help="print the report as JSON instead of a table")
    add("--plot", metavar="PNG", help="write latency CDFs and a throughput timeline")
    add(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live progress on stderr (default: when stderr is a terminal)",
    )


def config_from_args(args: argparse.Namespace, connection: ConnectionSettings) -> BenchConfig:
    """Raises ValueError with a sentence for inconsistent options."""
    return BenchConfig(
        target=connection.target,
        api_key=connection.api_key,
        tls_root_cert=connection.tls_root_cert,
        request_timeout_s=connection.timeout_s,
        num_requests=args.num_requests,
        duration_s=args.duration_s,
        arrival=args.arrival,
        interval_ms=args.interval_ms,
        rate_per_s=args.rate,
        num_users=args.users,
        seed=args.seed,
        prompt_repeats=args.prompt_repeats,
        shared_prefix=args.shared_prefix,
        same_prompt=args.same_prompt,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms,
    )


def run_from_args(config: BenchConfig, args: argparse.Namespace) -> int:
    """Run, print the table (or JSON) to stdout, plot if asked; exit status 1 if nothing ok."""
    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    report = run_bench(config, progress=sys.stderr if show_progress else None)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report_table({f"run {report.run_tag}": report}))
    if args.plot:
        from pagoda.client.bench_plot import plot_report

        plot_report(report, args.plot)
        print(f"pagoda: wrote {args.plot}", file=sys.stderr)
    return 0 if report.num_ok else 1


def _repeat_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"repeat counts must be >= 1, got {text!r}")
    return counts
