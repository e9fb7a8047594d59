"""The service against the weightless `--model dummy` worker: load, queueing, worker loss."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from pagoda.common import dummy_tokens
from pagoda.protos import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import running_service, stop_process, wait_serving, wait_until

pytestmark = pytest.mark.slow

VOCAB_SIZE = 49152


def dummy_continuation(prompt_ids: list[int], num_tokens: int) -> list[int]:
    """What the dummy worker generates after `prompt_ids`, token by token."""
    tokens = list(prompt_ids)
    for _ in range(num_tokens):
        tokens.append(dummy_tokens.dummy_next_token(tokens[-1], len(tokens) - 1, VOCAB_SIZE))
    return tokens[len(prompt_ids) :]


def request(prompt_ids: list[int], max_new_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt_ids),
        stopping=generation_pb2.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


async def stream_tokens(stub, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], int]:
    tokens: list[int] = []
    finish = 0
    async for response in stub.Generate(request(prompt_ids, max_new_tokens), timeout=120):
        tokens.extend(response.token_ids)
        finish = response.finish_reason
    return tokens, finish


async def many_streams(address: str, prompts: list[list[int]], max_new_tokens: int):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(*(stream_tokens(stub, p, max_new_tokens) for p in prompts))


def prompts(count: int, length: int = 40) -> list[list[int]]:
    return [[(7 * i + j) % 4000 + 10 for j in range(length + i % 13)] for i in range(count)]


@pytest.fixture(scope="module")
def dummy_service(tmp_path_factory):
    with running_service(
        tmp_path_factory.mktemp("dummy"),
        model="dummy",
        worker_args=["--num-kv-blocks", "512"],
        scheduler_args=["--max-num-batched-tokens", "256", "--max-active-requests", "32"],
    ) as service:
        yield service


def test_fifty_concurrent_streams_all_complete_with_exact_tokens(dummy_service):
    batch = prompts(50)
    results = asyncio.run(many_streams(dummy_service.address, batch, 32))
    for prompt_ids, (tokens, finish) in zip(batch, results, strict=True):
        assert finish == generation_pb2.LENGTH
        assert tokens == dummy_continuation(prompt_ids, 32)
    stats = dummy_service.stats()
    assert stats.num_running == stats.num_waiting == stats.num_kv_blocks_used == 0


def test_kv_pressure_preempts_without_losing_or_repeating_tokens(tmp_path):
    # 24 requests of ~100 tokens each need far more than 40 blocks of 16 tokens at once.
    with running_service(
        tmp_path,
        model="dummy",
        worker_args=["--num-kv-blocks", "40"],
        scheduler_args=["--no-prefix-caching"],
    ) as service:
        batch = prompts(24, length=60)

        async def streams_with_usage():
            async with grpc.aio.insecure_channel(service.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)

                async def one(prompt_ids):
                    responses = [r async for r in stub.Generate(request(prompt_ids, 48))]
                    tokens = [t for r in responses for t in r.token_ids]
                    return tokens, responses[-1].finish_reason, responses[-1].usage

                return await asyncio.gather(*(one(p) for p in batch))

        results = asyncio.run(streams_with_usage())
        for prompt_ids, (tokens, finish, _) in zip(batch, results, strict=True):
            assert finish == generation_pb2.LENGTH
            assert tokens == dummy_continuation(prompt_ids, 48)
        num_preemptions = service.stats().num_preemptions
        assert num_preemptions > 0
        # Each request's final usage says how often it was preempted.
        assert sum(usage.num_preemptions for _, _, usage in results) == num_preemptions


@pytest.mark.parametrize("stop_signal", [signal.SIGKILL, signal.SIGTERM], ids=["kill", "term"])
def test_worker_stopped_mid_stream_resumes_on_a_new_worker(tmp_path, stop_signal):
    """Killed or stopped on purpose, the worker's requests resume exactly on the next one.
    A kill makes the requests of the steps it lost suspects, run in halves until each
    samples (isolation); a worker stopped by SIGTERM says goodbye, so none is isolated."""
    with running_service(
        tmp_path,
        model="dummy",
        worker_args=["--dummy-step-ms", "5"],  # a step is in flight when the signal comes
        scheduler_args=["--max-num-batched-tokens", "64"],
    ) as service:
        batch = prompts(4, length=30)

        async def scenario():
            async with grpc.aio.insecure_channel(service.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                tasks = [asyncio.create_task(stream_tokens(stub, p, 3000)) for p in batch]
                await asyncio.to_thread(
                    wait_until,
                    lambda: service.stats().num_generated_tokens > 200,
                    60,
                    "tokens to flow",
                )
                await asyncio.to_thread(service.replace_worker, 60, stop_signal)
                return await asyncio.gather(*tasks)

        results = asyncio.run(scenario())
        for prompt_ids, (tokens, finish) in zip(batch, results, strict=True):
            assert finish == generation_pb2.LENGTH
            assert tokens == dummy_continuation(prompt_ids, 3000)
        num_isolated_steps = service.stats().num_isolated_steps
        if stop_signal == signal.SIGKILL:
            assert num_isolated_steps >= 2  # the two halves of the 4 suspects
        else:
            assert num_isolated_steps == 0


def test_no_worker_gives_unavailable_and_health_follows(tmp_path):
    with running_service(
        tmp_path, model="dummy", scheduler_args=["--worker-grace-s", "0.5"]
    ) as service:
        stop_process(service.worker)
        wait_until(lambda: not service.stats().worker_connected, 30, "the worker to be seen gone")
        with service.channel() as channel, pytest.raises(grpc.RpcError) as caught:
            list(service.stub(channel).Generate(request([5, 6, 7], 4), timeout=30))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        service.start_worker()
        wait_serving(service.address, [service.scheduler, service.worker])


def test_full_queue_gives_resource_exhausted(tmp_path):
    with running_service(
        tmp_path,
        model="dummy",
        scheduler_args=["--max-waiting-requests", "2", "--max-active-requests", "1"],
    ) as service:

        async def scenario():
            async with grpc.aio.insecure_channel(service.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                calls = [stub.Generate(request([5, 6, 7, i], 2000), timeout=120) for i in range(8)]
                outcomes = await asyncio.gather(*(_drain_code(c) for c in calls))
                return outcomes

        codes = asyncio.run(scenario())
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        assert grpc.StatusCode.OK in codes


async def _drain_code(call) -> grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_a_poison_request_fails_alone_and_the_others_finish(tmp_path):
    poison_token = 4999  # the dummy worker's forward raises on any step that feeds it
    with running_service(
        tmp_path, model="dummy", worker_args=["--fail-on-token-id", str(poison_token)]
    ) as service:
        batch = prompts(6)
        poisoned = [5, 6, poison_token, 7]

        async def scenario():
            async with grpc.aio.insecure_channel(service.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                good = [asyncio.create_task(stream_tokens(stub, p, 24)) for p in batch]
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stream_tokens(stub, poisoned, 24)
                return caught.value, await asyncio.gather(*good)

        error, results = asyncio.run(scenario())
        assert error.code() == grpc.StatusCode.INTERNAL
        assert "the worker failed on this request" in error.details()
        for prompt_ids, (tokens, finish) in zip(batch, results, strict=True):
            assert finish == generation_pb2.LENGTH
            assert tokens == dummy_continuation(prompt_ids, 24)
