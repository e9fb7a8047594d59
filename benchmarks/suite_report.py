"""`make bench` results: what one suite run measured, comparisons, the peer verdict, one plot.

Tables come from `format_report_table`; this module adds the sentences under them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.client.bench_report import BenchReport, LatencySummary

# Pagoda's target on every peer workload: completion tokens/s at least this many times the
# best peer's.
PEER_THROUGHPUT_TARGET = 1.5

# (label, report attribute, LatencySummary field) compared in every scenario.
COMPARED_LATENCIES = (
    ("TTFT p50", "ttft", "p50_ms"),
    ("TTFT p99", "ttft", "p99_ms"),
    ("ITL p99", "itl", "p99_ms"),
    ("TPOT p99", "tpot", "p99_ms"),
    ("E2E p99", "e2e", "p99_ms"),
)


@dataclass(slots=True)
class SuiteResults:
    """Everything measured in one suite run, keyed by scenario / workload, then column."""

    scenarios: dict[str, dict[str, BenchReport]] = field(default_factory=dict)
    scheduler_args: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    peer_workloads: dict[str, dict[str, BenchReport]] = field(default_factory=dict)
    peer_notes: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        def reports(runs: dict[str, BenchReport]) -> dict[str, Any]:
            return {label: report.to_dict() for label, report in runs.items()}

        return {
            "scenarios": {
                name: {"scheduler_args": self.scheduler_args.get(name, {}), "runs": reports(runs)}
                for name, runs in self.scenarios.items()
            },
            "peer_workloads": {
                name: {"notes": self.peer_notes.get(name, {}), "runs": reports(runs)}
                for name, runs in self.peer_workloads.items()
            },
        }


def latency_ms(report: BenchReport, name: str, statistic: str) -> float | None:
    summary: LatencySummary | None = getattr(report, name)
    return None if summary is None else getattr(summary, statistic)


def relative_change(before: float | None, after: float | None) -> float | None:
    """(after - before) / before, or None when either is missing or before is 0."""
    if before is None or after is None or before == 0:
        return None
    return (after - before) / before


def compare_line(label: str, baseline_label: str, baseline: BenchReport, other: BenchReport) -> str:
    """One sentence: how `other` moved each compared metric relative to `baseline`."""
    parts = []
    for metric, name, statistic in COMPARED_LATENCIES:
        before = latency_ms(baseline, name, statistic)
        after = latency_ms(other, name, statistic)
        change = relative_change(before, after)
        if change is not None:
            parts.append(f"{metric} {change:+.1%} ({_ms(before)} -> {_ms(after)} ms)")
    throughput = _ratio(other.completion_tokens_per_s, baseline.completion_tokens_per_s)
    if throughput is not None:
        parts.append(f"completion tok/s x{throughput:.2f}")
    return f"{label} vs {baseline_label}: " + ", ".join(parts)


def compare_variants(
    reports: dict[str, BenchReport], baselines: dict[str, str] | None = None
) -> list[str]:
    """A `compare_line` for every run but the first, against `baselines[label]` (default: the
    first run); a run that is its own baseline or whose baseline is missing gets none."""
    labels = list(reports)
    if not labels:
        return []
    baselines = baselines or {}
    lines = []
    for label in labels[1:]:
        baseline_label = baselines.get(label, labels[0])
        if baseline_label != label and baseline_label in reports:
            lines.append(
                compare_line(label, baseline_label, reports[baseline_label], reports[label])
            )
    return lines


def peer_verdict(pagoda: BenchReport, peers: dict[str, BenchReport]) -> list[str]:
    """Pagoda against the best peer: the throughput target and TTFT p99."""
    if not peers:
        return []
    best_name = max(peers, key=lambda name: peers[name].completion_tokens_per_s)
    best = peers[best_name]
    lines = []
    ratio = _ratio(pagoda.completion_tokens_per_s, best.completion_tokens_per_s)
    if ratio is not None:
        met = "met" if ratio >= PEER_THROUGHPUT_TARGET else "MISSED"
        lines.append(
            f"throughput: Pagoda {pagoda.completion_tokens_per_s:.0f} completion tok/s = "
            f"{ratio:.2f}x the best peer ({best_name}, {best.completion_tokens_per_s:.0f}); "
            f"target >= {PEER_THROUGHPUT_TARGET}x: {met}"
        )
    ours = latency_ms(pagoda, "ttft", "p99_ms")
    theirs = {
        name: value
        for name, report in peers.items()
        if (value := latency_ms(report, "ttft", "p99_ms")) is not None
    }
    if ours is not None and theirs:
        lowest_name = min(theirs, key=theirs.__getitem__)
        lowest = theirs[lowest_name]
        verdict = "lower" if ours < lowest else "NOT lower"
        lines.append(
            f"TTFT p99: Pagoda {ours:.0f} ms vs the lowest peer's {lowest:.0f} ms "
            f"({lowest_name}): {lowest / ours:.1f}x, {verdict}"
        )
    return lines


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def plot_cdfs(reports: dict[str, BenchReport], path: str | Path, title: str) -> None:
    """One small PNG: TTFT and ITL CDFs (log-scaled ms) of several runs overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for axis, (metric, pick) in zip(axes, _CDF_SERIES.items(), strict=True):
        for label, report in reports.items():
            samples_ms = sorted(pick(report))
            if samples_ms:
                fractions = [(i + 1) / len(samples_ms) for i in range(len(samples_ms))]
                axis.step(samples_ms, fractions, where="post", label=label)
        axis.set_xscale("log")
        axis.set_title(f"{metric} CDF")
        axis.set_xlabel("ms (log scale)")
        axis.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("fraction of requests / tokens <= x")
    axes[1].legend(fontsize=7, loc="lower right")
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


_CDF_SERIES = {
    "TTFT": lambda report: [
        r.ttft_s * 1000 for r in report.requests if r.ok and r.ttft_s is not None
    ],
    "ITL (per token)": lambda report: [
        itl * 1000 for r in report.requests if r.ok for itl in r.itls_s
    ],
}
