"""Plots of a load-generator run: latency CDFs and a completion-throughput timeline.

matplotlib (the `bench` extra) is imported only here, and only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path

from pagoda.client.bench_report import BenchReport

# The timeline uses about this many buckets over the run (each at least 0.1 s).
TIMELINE_BUCKETS = 60


def plot_report(report: BenchReport, path: str | Path) -> None:
    """Write a PNG: CDFs of TTFT, ITL and E2E (ms) and completion tokens/s over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            "--plot needs matplotlib; install the bench extra: pip install -e '.[bench]'"
        ) from exc

    ok = [result for result in report.requests if result.ok]
    series = {
        "TTFT": [r.ttft_s * 1000 for r in ok if r.ttft_s is not None],
        "ITL (per token)": [itl * 1000 for r in ok for itl in r.itls_s],
        "E2E": [r.e2e_s * 1000 for r in ok if r.e2e_s is not None],
    }
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, (name, samples_ms) in zip(axes.flat, series.items(), strict=False):
        ordered = sorted(samples_ms)
        if ordered:
            fractions = [(index + 1) / len(ordered) for index in range(len(ordered))]
            axis.step(ordered, fractions, where="post")
        axis.set_title(f"{name} CDF ({len(ordered)} samples)")
        axis.set_xlabel("ms")
        axis.set_ylabel("fraction <= x")
        axis.grid(alpha=0.3)

    bucket_s = max(report.duration_s / TIMELINE_BUCKETS, 0.1)
    num_buckets = int(report.duration_s / bucket_s) + 1
    tokens = [0] * num_buckets
    for result in report.requests:
        for time_s, count in zip(result.chunk_times_s, result.chunk_num_tokens, strict=True):
            tokens[min(int(time_s / bucket_s), num_buckets - 1)] += count
    timeline = axes.flat[3]
    timeline.plot([i * bucket_s for i in range(num_buckets)], [n / bucket_s for n in tokens])
    timeline.set_title("completion tokens/s")
    timeline.set_xlabel("s since start")
    timeline.set_ylabel("tokens/s")
    timeline.grid(alpha=0.3)

    figure.suptitle(
        f"{report.config.arrival_label}, {report.num_ok}/{report.num_requests_sent} ok, "
        f"{report.completion_tokens_per_s:.0f} completion tok/s"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
