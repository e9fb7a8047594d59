"""A step longer than --worker-timeout-s is not a lost worker while the worker says it is
still at it (heartbeats from its step pulse); one that runs past the worker's own
--hang-timeout-s is, and the scheduler's timeout then applies as before."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagoda.protos import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import running_service
from tests.e2e.test_dummy_service import dummy_continuation, prompts, stream_tokens

pytestmark = pytest.mark.slow


async def streams(address: str, batch: list[list[int]], max_new_tokens: int):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(
            *(stream_tokens(stub, prompt_ids, max_new_tokens) for prompt_ids in batch),
            return_exceptions=True,
        )


def test_steps_longer_than_the_worker_timeout_finish_without_a_loss(tmp_path):
    with running_service(
        tmp_path,
        model="dummy",
        # Every step twice the timeout; the worker's first beat comes within 1 s of a step's
        # start, then one every 0.5 s: 1 s spare.
        worker_args=["--dummy-step-ms", "4000"],
        scheduler_args=["--worker-timeout-s", "2"],
    ) as service:
        batch = prompts(2, length=8)
        results = asyncio.run(streams(service.address, batch, 3))
        for prompt_ids, (tokens, finish) in zip(batch, results, strict=True):
            assert finish == generation_pb2.LENGTH
            assert tokens == dummy_continuation(prompt_ids, 3)
        stats = service.stats()
        assert stats.worker_connected and stats.num_isolated_steps == 0
        assert "lost" not in service.logs()


def test_a_step_past_the_hang_timeout_loses_the_worker_and_its_request(tmp_path):
    """The worker vouches for a step for --hang-timeout-s only: a step that runs on counts
    as hung, so its requests become suspects, and the one that hangs alone fails."""
    with running_service(
        tmp_path,
        model="dummy",
        worker_args=["--dummy-step-ms", "4000", "--hang-timeout-s", "1"],
        scheduler_args=["--worker-timeout-s", "1"],
    ) as service:
        (outcome,) = asyncio.run(streams(service.address, prompts(1, length=8), 2))
        assert isinstance(outcome, grpc.aio.AioRpcError), outcome
        assert service.stats().num_isolated_steps >= 1
        assert "and no word for 1 s" in service.logs()
        assert "past --hang-timeout-s 1: taken as hung" in service.logs()
