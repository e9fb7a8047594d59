"""Data parallel on real processes: two workers behind one scheduler (--max-workers 2).

Each request runs on one worker and streams exactly what one worker streams; requests
spread over both; killing one worker mid-stream moves its requests to the other, and
every stream still completes in order with nothing lost or repeated."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
import time

import grpc
import pytest

from pagoda.protos import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import Service, _spawn, running_service, stop_process, wait_until
from tests.e2e.test_dummy_service import dummy_continuation
from tests.e2e.test_generation import EXACT, NUM_NEW_TOKENS, concurrent_greedy
from tests.e2e.test_overlap_service import stopping_requests, streamed
from tests.e2e.test_tensor_parallel import TINY_PROMPTS, generate, tiny_model  # noqa: F401

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def two_workers(tmp_path, *, model: str, worker_args: list[str], scheduler_args: list[str]):
    """A scheduler with --max-workers 2 and two workers attached; yields (service, second
    worker's process)."""
    with running_service(
        tmp_path,
        model=model,
        worker_args=worker_args,
        scheduler_args=["--max-workers", "2", *scheduler_args],
    ) as service:
        second = _spawn(
            [sys.executable, "-m", "pagoda.gpu_worker", "--zmq-endpoint", service.endpoint,
             *service.worker_args],
            tmp_path / f"worker-second-{time.monotonic_ns()}.log",
        )  # fmt: skip
        try:
            wait_until(lambda: len(service.stats().workers) == 2, 120, "two workers attached")
            yield service, second
        finally:
            stop_process(second)


def check_dummy_streams(requests, results) -> None:
    for request, (tokens, finish) in zip(requests, results, strict=True):
        expected = dummy_continuation(
            list(request.prompt_token_ids.ids), request.stopping.max_new_tokens
        )
        stops = set(request.stopping.stop_token_ids)
        ends = [i for i, token in enumerate(expected) if token in stops]
        if ends:
            assert (tokens, finish) == (expected[: ends[0] + 1], generation_pb2.STOP)
        else:
            assert (tokens, finish) == (expected, generation_pb2.LENGTH)


def test_two_dummy_workers_stream_exactly_what_one_does_and_share_the_load(tmp_path):
    requests = stopping_requests(60)
    with two_workers(
        tmp_path,
        model="dummy",
        worker_args=["--num-kv-blocks", "96", "--dummy-step-ms", "2"],  # preemptions too
        scheduler_args=["--max-num-batched-tokens", "96", "--max-active-requests", "24"],
    ) as (service, _):
        results = asyncio.run(streamed(service.address, requests))
        stats = service.stats()
    check_dummy_streams(requests, results)
    assert len(stats.workers) == 2
    assert all(worker.num_steps > 0 for worker in stats.workers), stats.workers
    assert stats.num_steps == sum(worker.num_steps for worker in stats.workers)
    assert stats.num_kv_blocks_total == sum(w.num_kv_blocks_total for w in stats.workers)
    assert stats.num_kv_blocks_used == 0 and stats.num_running == 0


async def stream_through_a_kill(service: Service, victim, requests) -> list:
    """Stream `requests`; once both workers run some and tokens flowed, SIGKILL `victim`."""

    async def one(stub, request):
        tokens, finish = [], 0
        async for response in stub.Generate(request, timeout=300):
            tokens.extend(response.token_ids)
            finish = response.finish_reason
        return tokens, finish

    async with grpc.aio.insecure_channel(service.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        tasks = [asyncio.create_task(one(stub, request)) for request in requests]
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "the workers never both ran requests"
            stats = await stub.GetServerStats(generation_pb2.ServerStatsRequest(), timeout=10)
            busy = [w for w in stats.workers if w.num_running > 0]
            if len(busy) == 2 and stats.num_generated_tokens > 0:
                break
            await asyncio.sleep(0.02)
        victim.send_signal(signal.SIGKILL)
        return await asyncio.gather(*tasks)


def test_killing_one_worker_mid_stream_leaves_every_stream_complete(tmp_path):
    requests = stopping_requests(24)
    for request in requests:
        request.stopping.max_new_tokens += 120  # long enough to be cut by the kill
    with two_workers(
        tmp_path,
        model="dummy",
        worker_args=["--num-kv-blocks", "512", "--dummy-step-ms", "5"],
        scheduler_args=["--max-num-batched-tokens", "256"],
    ) as (service, second):
        results = asyncio.run(stream_through_a_kill(service, second, requests))
        stats = service.stats()
    check_dummy_streams(requests, results)
    assert len(stats.workers) == 1 and stats.worker_connected
    # The kill did cut streams: the lost worker's requests moved to the other.
    log = (service.log_dir / "scheduler.log").read_text()
    moved = re.search(r"closed with its worker; (\d+) requests moved", log)
    assert moved is not None and int(moved.group(1)) > 0
    assert stats.num_running == 0 and stats.num_kv_blocks_used == 0


def test_two_cpu_workers_give_one_worker_s_greedy_tokens(tmp_path, tiny_model):  # noqa: F811
    directory, model = tiny_model
    prompts = TINY_PROMPTS * 2
    expected = [generate(model, ids, NUM_NEW_TOKENS) for ids in prompts]
    with two_workers(
        tmp_path,
        model=str(directory),
        worker_args=[*EXACT, "--device", "cpu"],
        scheduler_args=["--max-num-batched-tokens", "8"],  # chunked prompts too
    ) as (service, _):
        assert concurrent_greedy(service, prompts) == expected
        stats = service.stats()
    assert all(worker.num_steps > 0 for worker in stats.workers), stats.workers
