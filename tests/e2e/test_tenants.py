"""Tenants end to end (issue 27): a real scheduler and dummy worker, two API keys. One key
floods with long streams; the other's short requests still finish while the flood is in
progress (relative order, not wall-clock), the flood's requests beyond its cap are
refused naming the limit, and each key's GetServerStats shows its own tenant only. Under
a flood that holds every slot with streams far longer than the test, the other key's
requests take a flood request's slot (preempt to admit) instead of waiting for one to end."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from pagoda.protos import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import running_service

pytestmark = pytest.mark.slow

NUM_FLOOD = 100
MAX_TENANT_REQUESTS = 90
MAX_ACTIVE_REQUESTS = 8
NUM_PROBES = 5
FLOOD_TOKENS = 60


def two_keys_service(tmp_path: Path, limits: list[str]):
    """The scheduler with tenants `flood` (key-a) and `probe` (key-b) and `limits`, on a
    dummy worker of 10 ms steps."""
    keys = tmp_path / "api-keys"
    keys.write_text("flood:1:key-a\nprobe:1:key-b\n")
    keys.chmod(0o600)
    return running_service(
        tmp_path,
        model="dummy",
        scheduler_args=["--api-key-file", str(keys), *limits],
        worker_args=["--dummy-step-ms", "10"],
    )


def request(prompt_ids: list[int], max_new_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt_ids),
        stopping=generation_pb2.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


def bearer(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


async def scenario(address: str) -> dict:
    finished_floods: list[int] = []
    refusals: list[tuple[grpc.StatusCode, str]] = []
    probe_saw_floods_done: list[int] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        started = asyncio.Event()

        async def flood(index: int) -> None:
            call = stub.Generate(
                request([10 + index % 50] * 24, FLOOD_TOKENS), metadata=bearer("key-a"), timeout=300
            )
            try:
                async for response in call:
                    started.set()
                    if response.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
                        finished_floods.append(index)
            except grpc.aio.AioRpcError as error:
                refusals.append((error.code(), error.details()))

        floods = [asyncio.create_task(flood(i)) for i in range(NUM_FLOOD)]
        await started.wait()  # the flood holds the worker
        for index in range(NUM_PROBES):
            call = stub.Generate(
                request([7, 8, 9 + index], 4), metadata=bearer("key-b"), timeout=120
            )
            responses = [response async for response in call]
            assert responses[-1].usage.completion_tokens == 4
            probe_saw_floods_done.append(len(finished_floods))
        stats = {}
        for key in ("key-a", "key-b"):
            stats[key] = await stub.GetServerStats(
                generation_pb2.ServerStatsRequest(), metadata=bearer(key), timeout=10
            )
        await asyncio.gather(*floods)
    return dict(
        finished_floods=finished_floods,
        refusals=refusals,
        probe_saw_floods_done=probe_saw_floods_done,
        stats=stats,
    )


def test_a_flooding_key_does_not_starve_another_and_sees_only_itself(tmp_path):
    limits = ["--max-active-requests", str(MAX_ACTIVE_REQUESTS)]
    limits += ["--max-tenant-requests", str(MAX_TENANT_REQUESTS)]
    with two_keys_service(tmp_path, limits) as service:
        outcome = asyncio.run(scenario(service.address))
    # Beyond its cap, the flood is refused naming the limit; the other key is not.
    refusals = outcome["refusals"]
    assert len(refusals) == NUM_FLOOD - MAX_TENANT_REQUESTS, refusals
    for code, details in refusals:
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "max_tenant_requests" in details
    # A probe waits for the next free slot, not for the flood's queue: between two probes
    # at most one round of the flood's running requests ends (two, for slack). Behind the
    # whole queue, the first probe would see 80 of them done.
    seen = [0, *outcome["probe_saw_floods_done"]]
    gaps = [after - before for before, after in zip(seen[:-1], seen[1:], strict=True)]
    assert max(gaps) <= 2 * MAX_ACTIVE_REQUESTS, outcome["probe_saw_floods_done"]
    assert len(outcome["finished_floods"]) == MAX_TENANT_REQUESTS
    # Each key sees its own tenant, by name, never the other's.
    flood_stats, probe_stats = outcome["stats"]["key-a"], outcome["stats"]["key-b"]
    assert [t.tenant for t in flood_stats.tenants] == ["flood"]
    assert [t.tenant for t in probe_stats.tenants] == ["probe"]
    probe = probe_stats.tenants[0]
    assert probe.num_requests_finished == NUM_PROBES and probe.num_waiting == 0
    assert probe.ttft_bucket_counts[-1] == NUM_PROBES
    assert flood_stats.tenants[0].num_running + flood_stats.tenants[0].num_waiting > 0
    assert "key-" not in str(flood_stats) + str(probe_stats)


# The flood that holds every slot: NUM_LONG_FLOOD streams, LONG_FLOOD_RUNNING of them
# running, each far longer than the probes take (cancelled at the end); their KV fits the
# dummy's pool (4,096 blocks of 16), so only the slots are short.
NUM_LONG_FLOOD = 600
LONG_FLOOD_RUNNING = 16
LONG_FLOOD_TOKENS = 3000


async def long_flood_scenario(address: str) -> dict:
    finished_floods: list[int] = []
    probes_done_with_floods_done: list[int] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def flood(index: int) -> None:
            call = stub.Generate(
                request([10 + index % 50] * 24, LONG_FLOOD_TOKENS),
                metadata=bearer("key-a"),
                timeout=600,
            )
            try:
                async for response in call:
                    if response.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
                        finished_floods.append(index)
            except asyncio.CancelledError:
                call.cancel()
                raise

        async def flood_stats() -> generation_pb2.TenantStats:
            stats = await stub.GetServerStats(
                generation_pb2.ServerStatsRequest(), metadata=bearer("key-a"), timeout=10
            )
            return stats.tenants[0] if stats.tenants else generation_pb2.TenantStats()

        floods = [asyncio.create_task(flood(i)) for i in range(NUM_LONG_FLOOD)]
        while True:  # until every flood stream is in, every slot taken
            tenant = await flood_stats()
            if tenant.num_running == LONG_FLOOD_RUNNING and (
                tenant.num_running + tenant.num_waiting == NUM_LONG_FLOOD
            ):
                break
            await asyncio.sleep(0.05)
        for index in range(NUM_PROBES):
            call = stub.Generate(
                request([7, 8, 9 + index], 4), metadata=bearer("key-b"), timeout=300
            )
            responses = [response async for response in call]
            assert responses[-1].usage.completion_tokens == 4
            probes_done_with_floods_done.append(len(finished_floods))
        flood_tenant = await flood_stats()
        for task in floods:
            task.cancel()
        await asyncio.gather(*floods, return_exceptions=True)
    return dict(
        probes_done_with_floods_done=probes_done_with_floods_done, flood_tenant=flood_tenant
    )


def test_a_flood_holding_every_slot_gives_a_slot_to_the_other_key(tmp_path):
    """Without preempt to admit, the first probe waits for a flood stream to end (3,000
    steps); with it, every probe finishes while none has, each one costing the flood at
    most one preemption."""
    limits = ["--max-active-requests", str(LONG_FLOOD_RUNNING)]
    limits += ["--max-waiting-requests", str(2 * NUM_LONG_FLOOD)]
    limits += ["--max-tenant-waiting-requests", str(NUM_LONG_FLOOD)]
    with two_keys_service(tmp_path, limits) as service:
        outcome = asyncio.run(long_flood_scenario(service.address))
    assert outcome["probes_done_with_floods_done"] == [0] * NUM_PROBES
    assert 1 <= outcome["flood_tenant"].num_preemptions <= NUM_PROBES
