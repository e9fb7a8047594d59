"""`--admission-policy deadline` on real processes: a call's gRPC deadline reaches the
scheduler, which starts the caller that gives up first."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagoda.protos import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import running_service

pytestmark = pytest.mark.slow


def request(index: int, max_new_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=[100 + index] * 8),
        stopping=generation_pb2.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


async def first_tokens_in_order(address: str) -> list[str]:
    """One long request runs; then "plain" (no deadline) and "urgent" (a deadline) wait,
    in that order; the names in the order their first tokens came."""
    order: list[str] = []

    async def call(stub, name: str, message, timeout: float | None) -> None:
        async for response in stub.Generate(message, timeout=timeout):
            if response.token_ids and name not in order:
                order.append(name)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        running = asyncio.create_task(call(stub, "running", request(0, 200), None))
        while not order:  # it runs: the others wait behind it
            await asyncio.sleep(0.01)
        plain = asyncio.create_task(call(stub, "plain", request(1, 4), None))
        while (await stub.GetServerStats(generation_pb2.ServerStatsRequest())).num_waiting < 1:
            await asyncio.sleep(0.01)  # until it waits: it arrived first
        urgent = asyncio.create_task(call(stub, "urgent", request(2, 4), 120.0))
        await asyncio.gather(running, plain, urgent)
    return order


@pytest.mark.parametrize(("policy", "expected"), [("deadline", "urgent"), ("fifo", "plain")])
def test_the_caller_with_a_deadline_starts_first(tmp_path, policy, expected):
    with running_service(
        tmp_path,
        model="dummy",
        worker_args=["--dummy-step-ms", "5"],
        scheduler_args=[
            "--admission-policy",
            policy,
            "--max-active-requests",
            "1",
            "--force-fifo-every",
            "0",  # no forced arrival-order round in between
        ],  # fmt: skip
    ) as service:
        order = asyncio.run(first_tokens_in_order(service.address))
    assert order[0] == "running" and order[1] == expected, order
