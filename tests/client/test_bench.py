"""The load generator: workload, statistics, and runs against the fake server."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.client.bench import BenchConfig, format_report_table, run_bench
from pagoda.client.bench_report import LatencySummary, RequestResult, percentile, summarize
from pagoda.client.bench_workload import FILLER_WORDS, arrival_offsets_s, build_prompts, filler_text
from pagoda.client.results import Timings, Usage

REPO_ROOT = Path(__file__).resolve().parents[2]


# -- workload -------------------------------------------------------------------------------


def test_filler_repeats_one_word_per_count():
    assert filler_text(3) == " the of and"
    assert len(filler_text(25).split()) == 25
    assert filler_text(len(FILLER_WORDS) + 1).endswith(" the")


def test_unique_prompts_cycle_repeat_counts_and_share_no_tag():
    config = BenchConfig(num_requests=6, prompt_repeats=(8, 1, 2))
    prompts = build_prompts(config, "tag")
    assert [len(p.split()) - 1 for p in prompts] == [8, 1, 2, 8, 1, 2]
    assert prompts[0].startswith("[tag-0] the") and prompts[3].startswith("[tag-3] the")
    assert len(set(prompts)) == 6


def test_shared_prefix_and_same_prompt():
    shared = build_prompts(BenchConfig(num_requests=2, shared_prefix="SYS:"), "t")
    assert shared[0].startswith("SYS: [t-0]") and shared[1].startswith("SYS: [t-1]")
    same = build_prompts(BenchConfig(num_requests=3, same_prompt=True, prompt_repeats=(4,)), "t")
    assert same == ["[t] the of and to"] * 3


def test_arrival_offsets():
    assert arrival_offsets_s(BenchConfig(num_requests=3)) == [0.0, 0.0, 0.0]
    interval = BenchConfig(num_requests=3, arrival="interval", interval_ms=250)
    assert arrival_offsets_s(interval) == [0.0, 0.25, 0.5]
    poisson = BenchConfig(num_requests=2000, arrival="poisson", rate_per_s=50, seed=3)
    offsets = arrival_offsets_s(poisson)
    assert offsets == arrival_offsets_s(poisson)  # seeded
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert 30 < len(offsets) / offsets[-1] < 70  # about 50 per second
    assert arrival_offsets_s(BenchConfig(arrival="closed")) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arrival": "storm"}, "arrival"),
        ({"num_requests": 0}, "num_requests"),
        ({"prompt_repeats": (4, 0)}, "prompt_repeats"),
        ({"same_prompt": True, "shared_prefix": "x"}, "exclude"),
        ({"slo_ttft_ms": -1}, "slo_ttft_ms"),
    ],
)
def test_config_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(**kwargs)


# -- statistics -----------------------------------------------------------------------------


def test_percentile_interpolates():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert (percentile(values, 0), percentile(values, 50), percentile(values, 100)) == (1, 3, 5)
    assert percentile(values, 95) == pytest.approx(4.8)
    assert percentile([7.0], 99) == 7.0
    summary = LatencySummary.of_seconds([0.003, 0.001, 0.002])
    assert (summary.count, summary.p50_ms, summary.max_ms) == (3, 2.0, 3.0)
    assert LatencySummary.of_seconds([]) is None


def make_result(index, send_s, chunk_times_s, chunk_num_tokens, end_s, **kwargs):
    return RequestResult(
        index=index,
        send_s=send_s,
        chunk_times_s=list(chunk_times_s),
        chunk_num_tokens=list(chunk_num_tokens),
        end_s=end_s,
        usage=Usage(10, sum(chunk_num_tokens), 4),
        timings=Timings(queued_ms=2.0, first_token_ms=0, total_ms=0),
        **kwargs,
    )


def test_request_metrics_spread_coalesced_chunks_over_their_tokens():
    result = make_result(0, 1.0, [1.1, 1.2, 1.5], [1, 1, 3], 1.6)
    assert result.ttft_s == pytest.approx(0.1)
    assert result.e2e_s == pytest.approx(0.6)
    assert result.itls_s == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert result.tpot_s == pytest.approx(0.4 / 4)


def test_summarize_counts_tokens_errors_and_goodput():
    config = BenchConfig(num_requests=4, slo_ttft_ms=150, slo_itl_ms=150)
    results = [
        make_result(0, 0.0, [0.1, 0.2], [1, 1], 0.25),  # meets both SLOs
        make_result(1, 0.0, [0.3, 0.4], [1, 1], 0.45),  # TTFT too slow
        make_result(2, 0.0, [0.1, 0.5], [1, 1], 0.55),  # one gap too slow
        RequestResult(index=3, send_s=0.0, end_s=0.05, error_code="RESOURCE_EXHAUSTED"),
    ]
    report = summarize(config, "t", results, duration_s=1.0, num_preemptions=2)
    assert (report.num_requests_sent, report.num_ok, report.num_errors) == (4, 3, 1)
    assert report.errors_by_code == {"RESOURCE_EXHAUSTED": 1}
    assert report.goodput_requests_per_s == pytest.approx(1.0)
    assert report.requests_per_s == pytest.approx(3.0)
    assert report.num_completion_tokens == 6 and report.num_prompt_tokens == 30
    assert report.num_cached_prompt_tokens == 12 and report.num_preemptions == 2
    assert report.total_tokens_per_s == pytest.approx(36.0)
    assert report.ttft.count == 3 and report.queue.p99_ms == pytest.approx(2.0)
    json.dumps(report.to_dict(include_requests=True))


# -- runs against the fake server -----------------------------------------------------------


def check_sane(report, num_requests: int, max_new_tokens: int) -> None:
    assert report.num_ok == report.num_requests_sent == num_requests
    assert report.num_errors == 0 and report.num_unfinished == 0
    assert report.num_completion_tokens == num_requests * max_new_tokens
    assert report.duration_s > 0 and report.completion_tokens_per_s > 0
    for summary in (report.ttft, report.itl, report.tpot, report.e2e, report.queue):
        assert 0 <= summary.p50_ms <= summary.p95_ms <= summary.p99_ms <= summary.max_ms
    assert report.ttft.p50_ms <= report.e2e.p50_ms
    assert report.queue.p50_ms == 0.5  # the fake's timings.queued_ms


def test_burst_run_against_the_fake_server(make_server):
    server = make_server(token_delay_s=0.002, preemptions_per_request=1)
    progress = io.StringIO()
    config = BenchConfig(
        target=server.target, num_requests=8, max_new_tokens=4, prompt_repeats=(16, 1),
        slo_ttft_ms=10_000, slo_itl_ms=10_000,
    )  # fmt: skip
    report = run_bench(config, progress=progress)
    check_sane(report, 8, 4)
    assert report.num_preemptions == 8
    assert report.goodput_requests_per_s == pytest.approx(report.requests_per_s)
    assert report.num_prompt_tokens == 4 * 17 + 4 * 2  # words, as the fake counts them
    assert progress.getvalue().endswith("8/8 done, 0 errors\n")
    prompts = [c.request.prompt for c in server.servicer.requests if c.method == "Generate"]
    assert len(set(prompts)) == 8
    request_ids = {c.request.request_id for c in server.servicer.requests if c.method == "Generate"}
    assert request_ids == {f"bench-{report.run_tag}-{i}" for i in range(8)}


@pytest.mark.parametrize(
    "arrival", [dict(arrival="closed", num_users=3), dict(arrival="interval", interval_ms=2),
                dict(arrival="poisson", rate_per_s=500, seed=1)],
)  # fmt: skip
def test_other_arrival_patterns(make_server, arrival):
    server = make_server(token_delay_s=0.001)
    config = BenchConfig(target=server.target, num_requests=7, max_new_tokens=3, **arrival)
    check_sane(run_bench(config), 7, 3)


def test_same_prompt_hits_the_cache(make_server):
    server = make_server()
    config = BenchConfig(
        target=server.target, num_requests=4, max_new_tokens=2, same_prompt=True,
        arrival="closed", num_users=1, prompt_repeats=(9,),
    )  # fmt: skip
    report = run_bench(config)
    # The fake reports all but one prompt token cached for a prompt it has seen.
    assert report.num_cached_prompt_tokens == 3 * 9
    assert report.goodput_requests_per_s is None


def test_duration_cap_cancels_what_is_still_running(make_server):
    server = make_server(token_delay_s=0.05)
    config = BenchConfig(target=server.target, num_requests=3, max_new_tokens=500, duration_s=0.3)
    report = run_bench(config)
    assert report.num_unfinished == 3 and report.num_ok == 0
    assert report.num_completion_tokens > 0
    for index in range(3):
        assert server.servicer.wait_cancelled(f"bench-{report.run_tag}-{index}", timeout_s=10)


def test_errors_are_counted_by_code(auth_server):
    config = BenchConfig(target=auth_server.target, num_requests=3, max_new_tokens=2)
    report = run_bench(config)
    assert report.errors_by_code == {"UNAUTHENTICATED": 3} and report.num_ok == 0
    assert report.num_preemptions is None and report.ttft is None
    assert "UNAUTHENTICATED 3" in format_report_table({"refused": report})


def test_format_report_table_puts_runs_side_by_side(make_server):
    server = make_server()
    base = dict(target=server.target, num_requests=2, max_new_tokens=2)
    reports = {
        "burst": run_bench(BenchConfig(**base)),
        "closed-1": run_bench(BenchConfig(arrival="closed", num_users=1, **base)),
    }
    table = format_report_table(reports)
    header = table.splitlines()[0].split()
    assert header == ["metric", "burst", "closed-1"]
    for label in ("TTFT ms p50/p95/p99", "ITL ms p50/p95/p99", "goodput req/s", "preemptions"):
        assert label in table
    assert "closed 1 users" in table and "2/2" in table


def run_bench_cli(*args: str):
    return subprocess.run(
        [sys.executable, "-m", "pagoda.client", "bench", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )


def test_bench_cli_json(make_server):
    server = make_server(token_delay_s=0.001)
    result = run_bench_cli(
        "--target", server.target, "--num-requests", "6", "--arrival", "poisson", "--rate", "300",
        "--max-new-tokens", "3", "--prompt-repeats", "32,1,1", "--ignore-eos",
        "--slo-ttft-ms", "5000", "--slo-itl-ms", "5000", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["num_ok"], report["num_completion_tokens"]) == (6, 18)
    assert report["config"]["prompt_repeats"] == [32, 1, 1]
    assert report["config"]["arrival"] == "poisson" and "api_key" not in report["config"]
    assert report["ttft"]["p50_ms"] <= report["e2e"]["p99_ms"]
    assert report["goodput_requests_per_s"] > 0
    request = server.servicer.last_request("Generate")
    assert request.stopping.ignore_eos and request.stopping.max_new_tokens == 3


def test_bench_cli_table_and_plot(make_server, tmp_path):
    pytest.importorskip("matplotlib")
    server = make_server(token_delay_s=0.001)
    plot = tmp_path / "bench.png"
    result = subprocess.run(
        [sys.executable, "-m", "client.bench", "--target", server.target, "--num-requests", "4",
         "--max-new-tokens", "3", "--plot", str(plot), "--same-prompt"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "requests ok/sent" in result.stdout and "4/4" in result.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cli_usage_errors():
    assert run_bench_cli("--arrival", "storm").returncode == 2
    assert run_bench_cli("--prompt-repeats", "4,x").returncode == 2
    assert run_bench_cli("--same-prompt", "--shared-prefix", "x").returncode == 2
    assert run_bench_cli("--num-requests", "0").returncode == 2
