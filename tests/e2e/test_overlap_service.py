"""Overlapped steps on real processes: a worker that feeds its last sampled tokens behind a
scheduler that plans step N+1 while N runs gives the same greedy output as one step at a
time (--no-overlap-steps), on the dummy worker and on a tiny real model."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from pagoda.protos import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import running_service
from tests.e2e.test_dummy_service import dummy_continuation, prompts
from tests.e2e.test_generation import EXACT, NUM_NEW_TOKENS, concurrent_greedy
from tests.e2e.test_tensor_parallel import TINY_PROMPTS, generate, tiny_model  # noqa: F401

pytestmark = pytest.mark.slow

SCHEDULER_ARGS = ["--max-num-batched-tokens", "96", "--max-active-requests", "24"]


def stopping_requests(count: int) -> list[generation_pb2.GenerateRequest]:
    """Requests of varied lengths; every third stops on a token id it samples early, so
    its stop is discovered while the next step, which fed it ahead, is in flight."""
    requests = []
    for index, prompt in enumerate(prompts(count)):
        max_new_tokens = 12 + index % 17
        stop_token_ids = []
        if index % 3 == 0:
            stop_token_ids = [dummy_continuation(prompt, 6)[4 + index % 2]]
        requests.append(
            generation_pb2.GenerateRequest(
                prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
                stopping=generation_pb2.StoppingCriteria(
                    max_new_tokens=max_new_tokens,
                    stop_token_ids=stop_token_ids,
                    ignore_eos=True,
                ),
            )
        )
    return requests


async def streamed(address: str, requests) -> list[tuple[list[int], int]]:
    async def one(stub, request):
        tokens, finish = [], 0
        async for response in stub.Generate(request, timeout=120):
            tokens.extend(response.token_ids)
            finish = response.finish_reason
        return tokens, finish

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(*(one(stub, request) for request in requests))


@pytest.mark.parametrize("overlap", [True, False])
def test_dummy_worker_streams_are_exact_with_and_without_overlap(tmp_path, overlap):
    requests = stopping_requests(60)
    flag = "--overlap-steps" if overlap else "--no-overlap-steps"
    with running_service(
        tmp_path,
        model="dummy",
        worker_args=["--num-kv-blocks", "96", "--dummy-step-ms", "2"],  # preemptions too
        scheduler_args=[*SCHEDULER_ARGS, flag],
    ) as service:
        results = asyncio.run(streamed(service.address, requests))
        stats = service.stats()
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
    assert stats.num_kv_blocks_used == 0 and stats.num_running == 0
    assert stats.worker_busy_s > 0


def test_tiny_model_greedy_output_is_generate_s_with_and_without_overlap(tmp_path, tiny_model):  # noqa: F811
    directory, model = tiny_model
    expected = [generate(model, ids, NUM_NEW_TOKENS) for ids in TINY_PROMPTS]
    for flag in ("--overlap-steps", "--no-overlap-steps"):
        log_dir = tmp_path / flag.lstrip("-")
        log_dir.mkdir()
        with running_service(
            log_dir,
            model=str(directory),
            worker_args=[*EXACT, "--device", "cpu"],
            scheduler_args=["--max-num-batched-tokens", "8", flag],  # chunked prompts too
        ) as service:
            assert concurrent_greedy(service, TINY_PROMPTS) == expected, flag
            assert service.stats().num_kv_blocks_used == 0


def test_tiny_model_steps_launched_ahead_give_generate_s_output(tmp_path, tiny_model):  # noqa: F811
    """--launch-ahead on: the worker enqueues step N+1 (its rows fed N's tokens where N
    sampled them) before it reads N. On a CPU nothing overlaps, but every step after the
    first may go through that bookkeeping, through the real scheduler and socket."""
    directory, model = tiny_model
    expected = [generate(model, ids, NUM_NEW_TOKENS) for ids in TINY_PROMPTS]
    with running_service(
        tmp_path,
        model=str(directory),
        worker_args=[*EXACT, "--device", "cpu", "--launch-ahead", "on"],
        scheduler_args=["--max-num-batched-tokens", "8", "--overlap-steps"],
    ) as service:
        assert concurrent_greedy(service, TINY_PROMPTS) == expected
        assert service.stats().num_kv_blocks_used == 0
    (log_path,) = tmp_path.glob("worker-*.log")
    log = log_path.read_text()
    assert "steps launched ahead: yes" in log
    launched = re.search(r"(\d+) of (\d+) steps were launched ahead", log)
    assert launched is not None and int(launched[1]) > int(launched[2]) // 2, launched
