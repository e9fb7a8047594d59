"""`make bench`'s OpenAI peer (benchmarks.openai_peer) against a live pagoda-openai over a
real scheduler and dummy worker: every request served, the tokens counted per event as the
gRPC load generator counts them on the same workload (no timings asserted)."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.openai_peer import OpenAIPeerError, run_workload, run_workload_async
from pagoda.client.bench import run_bench
from pagoda.client.bench_config import BenchConfig
from tests.openai_front.conftest import API_KEY

pytestmark = pytest.mark.slow

NUM_REQUESTS = 6
NUM_TOKENS = 8


def prompts(num_requests: int) -> list[list[int]]:
    return [[100 + i, 200, 300, 400 + i] for i in range(num_requests)]


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=120))


@pytest.mark.parametrize("arrival", ["burst", "interval"])
def test_every_request_and_token_is_counted(front, arrival):
    config = BenchConfig(
        num_requests=NUM_REQUESTS, arrival=arrival, interval_ms=30,
        max_new_tokens=NUM_TOKENS, ignore_eos=True,
    )  # fmt: skip
    ids = prompts(NUM_REQUESTS)
    report = run(run_workload_async(front.url, config, ids, "t", api_key=API_KEY))
    assert (report.num_requests_sent, report.num_ok, report.num_errors) == (NUM_REQUESTS,) * 2 + (
        0,
    )
    assert report.num_completion_tokens == NUM_REQUESTS * NUM_TOKENS
    assert report.num_prompt_tokens == sum(len(p) for p in ids)
    for request in report.requests:
        assert sum(request.chunk_num_tokens) == NUM_TOKENS
        assert request.finish_reason == "length"
        assert request.chunk_times_s == sorted(request.chunk_times_s)
    assert report.ttft is not None and report.itl is not None


def test_the_same_workload_through_grpc_counts_the_same(front):
    config = BenchConfig(
        target=front.service.address, api_key=API_KEY, num_requests=4,
        prompt_repeats=(6,), max_new_tokens=NUM_TOKENS, ignore_eos=True,
    )  # fmt: skip
    grpc_report = run_bench(config)
    http_report = run_workload(front.url, config, prompts(4), "t", api_key=API_KEY)  # warmed up
    for report in (grpc_report, http_report):
        assert report.num_ok == 4 and report.num_completion_tokens == 4 * NUM_TOKENS


def test_a_refused_key_fails_the_run_with_a_sentence(front):
    config = BenchConfig(num_requests=1, max_new_tokens=2)
    with pytest.raises(OpenAIPeerError, match="401"):
        run(run_workload_async(front.url, config, prompts(1), "t", api_key="wrong"))
