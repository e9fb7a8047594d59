"""Load-generator results: what each request saw, the run's summary, and comparison tables.

Definitions (all client-side, from chunk arrival times):
- TTFT: send to the first chunk carrying a token.
- ITL: the gap between two token-carrying chunks divided by the tokens in the later one, once
  per token (so coalesced chunks count as evenly spaced tokens).
- TPOT: (last token time - first token time) / (completion tokens - 1), per request.
- E2E: send to the end of the stream.
- queue: the server's `timings.queued_ms` from the last message.
Latency percentiles cover successful requests only. A request meets the SLOs when its TTFT is
within `slo_ttft_ms` and its worst ITL within `slo_itl_ms` (an unset SLO always holds);
goodput is such requests per second of run time.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda.client.bench_config import BenchConfig
from pagoda.client.results import Timings, Usage


@dataclass(slots=True)
class RequestResult:
    """One request of a run; times are seconds since the run started."""

    index: int
    send_s: float
    # Arrival time and token count of each chunk that carried tokens, in order.
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_num_tokens: list[int] = field(default_factory=list)
    end_s: float | None = None
    # A grpc.StatusCode name, or None.
    error_code: str | None = None
    # Still running when the run's duration_s ran out (then cancelled).
    unfinished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None

    @property
    def ok(self) -> bool:
        return self.error_code is None and not self.unfinished and self.end_s is not None

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.chunk_num_tokens)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.send_s if self.chunk_times_s else None

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.send_s

    @property
    def itls_s(self) -> list[float]:
        gaps = []
        times, counts = self.chunk_times_s, self.chunk_num_tokens
        for k in range(1, len(times)):
            gaps += [(times[k] - times[k - 1]) / counts[k]] * counts[k]
        return gaps

    @property
    def tpot_s(self) -> float | None:
        if self.num_completion_tokens < 2:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (self.num_completion_tokens - 1)


@dataclass(frozen=True, slots=True)
class LatencySummary:
    count: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float

    @staticmethod
    def of_seconds(samples_s: Sequence[float]) -> LatencySummary | None:
        if not samples_s:
            return None
        ordered = sorted(sample * 1000 for sample in samples_s)
        return LatencySummary(
            count=len(ordered),
            mean_ms=math.fsum(ordered) / len(ordered),
            p50_ms=percentile(ordered, 50),
            p95_ms=percentile(ordered, 95),
            p99_ms=percentile(ordered, 99),
            max_ms=ordered[-1],
        )


def percentile(ordered: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, interpolating linearly between ranks."""
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class BenchReport:
    """The summary of one run; `requests` keeps every request's raw times (for plots)."""

    config: BenchConfig
    run_tag: str
    num_requests_sent: int
    num_ok: int
    num_unfinished: int
    errors_by_code: dict[str, int]
    duration_s: float
    requests_per_s: float
    # None when no SLO was given.
    goodput_requests_per_s: float | None
    completion_tokens_per_s: float
    total_tokens_per_s: float
    ttft: LatencySummary | None
    tpot: LatencySummary | None
    itl: LatencySummary | None
    e2e: LatencySummary | None
    queue: LatencySummary | None
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_prompt_tokens: int
    # Server-side delta over the run; None when GetServerStats failed.
    num_preemptions: int | None
    requests: list[RequestResult] = field(repr=False, compare=False)

    @property
    def num_errors(self) -> int:
        return sum(self.errors_by_code.values())

    def to_dict(self, include_requests: bool = False) -> dict[str, Any]:
        """JSON-ready (no secrets); per-request records only when asked."""
        values = {
            item.name: getattr(self, item.name)
            for item in dataclasses.fields(self)
            if item.name not in ("config", "requests")
        }
        for name in ("ttft", "tpot", "itl", "e2e", "queue"):
            summary = values[name]
            values[name] = None if summary is None else dataclasses.asdict(summary)
        values["num_errors"] = self.num_errors
        values["config"] = self.config.to_dict()
        if include_requests:
            values["requests"] = [dataclasses.asdict(result) for result in self.requests]
        return values


def summarize(
    config: BenchConfig,
    run_tag: str,
    results: Sequence[RequestResult],
    duration_s: float,
    num_preemptions: int | None,
) -> BenchReport:
    """Reduce a run's per-request results to its report."""
    ok = [result for result in results if result.ok]
    usages = [result.usage for result in ok if result.usage is not None]
    num_prompt_tokens = sum(usage.prompt_tokens for usage in usages)
    num_completion_tokens = sum(result.num_completion_tokens for result in results)
    duration_s = max(duration_s, 1e-9)
    goodput = None
    if config.slo_ttft_ms is not None or config.slo_itl_ms is not None:
        goodput = sum(_meets_slo(config, result) for result in ok) / duration_s
    return BenchReport(
        config=config,
        run_tag=run_tag,
        num_requests_sent=len(results),
        num_ok=len(ok),
        num_unfinished=sum(result.unfinished for result in results),
        errors_by_code=dict(Counter(r.error_code for r in results if r.error_code is not None)),
        duration_s=duration_s,
        requests_per_s=len(ok) / duration_s,
        goodput_requests_per_s=goodput,
        completion_tokens_per_s=num_completion_tokens / duration_s,
        total_tokens_per_s=(num_prompt_tokens + num_completion_tokens) / duration_s,
        ttft=LatencySummary.of_seconds([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=LatencySummary.of_seconds([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl=LatencySummary.of_seconds([itl for r in ok for itl in r.itls_s]),
        e2e=LatencySummary.of_seconds([r.e2e_s for r in ok if r.e2e_s is not None]),
        queue=LatencySummary.of_seconds(
            [r.timings.queued_ms / 1000 for r in ok if r.timings is not None]
        ),
        num_prompt_tokens=num_prompt_tokens,
        num_completion_tokens=num_completion_tokens,
        num_cached_prompt_tokens=sum(usage.cached_prompt_tokens for usage in usages),
        num_preemptions=num_preemptions,
        requests=list(results),
    )


def _meets_slo(config: BenchConfig, result: RequestResult) -> bool:
    ttft_s = result.ttft_s
    if config.slo_ttft_ms is not None and (ttft_s is None or ttft_s * 1000 > config.slo_ttft_ms):
        return False
    itls_s = result.itls_s
    return config.slo_itl_ms is None or not itls_s or max(itls_s) * 1000 <= config.slo_itl_ms


def format_report_table(reports: dict[str, BenchReport]) -> str:
    """Several runs side by side: one row per metric, one column per run (named by key)."""
    rows: list[tuple[str, list[str]]] = [
        ("arrival", [r.config.arrival_label for r in reports.values()]),
        ("prompts", [_workload_label(r.config) for r in reports.values()]),
        ("requests ok/sent", [f"{r.num_ok}/{r.num_requests_sent}" for r in reports.values()]),
        ("errors", [_errors_label(r) for r in reports.values()]),
        ("unfinished", [str(r.num_unfinished) for r in reports.values()]),
        ("duration s", [_number(r.duration_s) for r in reports.values()]),
        ("requests/s", [_number(r.requests_per_s) for r in reports.values()]),
        ("goodput req/s", [_number(r.goodput_requests_per_s) for r in reports.values()]),
        ("completion tok/s", [_number(r.completion_tokens_per_s) for r in reports.values()]),
        ("total tok/s", [_number(r.total_tokens_per_s) for r in reports.values()]),
    ]
    for label, name in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e")):
        rows.append(
            (f"{label} ms p50/p95/p99", [_percentiles(getattr(r, name)) for r in reports.values()])
        )
    rows += [
        ("queue ms p50/p95/p99", [_percentiles(r.queue) for r in reports.values()]),
        ("prompt tokens", [str(r.num_prompt_tokens) for r in reports.values()]),
        ("cached prompt tokens", [_cached_label(r) for r in reports.values()]),
        ("completion tokens", [str(r.num_completion_tokens) for r in reports.values()]),
        ("preemptions", [_number(r.num_preemptions) for r in reports.values()]),
    ]
    header = ("metric", list(reports))
    widths = [max(len(label) for label, _ in [header, *rows])]
    for column in range(len(reports)):
        widths.append(max(len(cells[column]) for _, cells in [header, *rows]))
    lines = []
    for index, (label, cells) in enumerate([header, *rows]):
        parts = [label.ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(cells, widths[1:], strict=True)
        ]
        lines.append("  ".join(parts).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) or abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def _percentiles(summary: LatencySummary | None) -> str:
    if summary is None:
        return "-"
    return "/".join(_number(v) for v in (summary.p50_ms, summary.p95_ms, summary.p99_ms))


def _errors_label(report: BenchReport) -> str:
    if not report.errors_by_code:
        return "0"
    details = ", ".join(f"{code} {n}" for code, n in sorted(report.errors_by_code.items()))
    return f"{report.num_errors} ({details})"


def _cached_label(report: BenchReport) -> str:
    if not report.num_prompt_tokens:
        return str(report.num_cached_prompt_tokens)
    share = 100 * report.num_cached_prompt_tokens / report.num_prompt_tokens
    return f"{report.num_cached_prompt_tokens} ({share:.0f}%)"


def _workload_label(config: BenchConfig) -> str:
    repeats = ",".join(str(r) for r in config.prompt_repeats)
    return f"{config.prompt_mode} x{repeats} -> {config.max_new_tokens}"
