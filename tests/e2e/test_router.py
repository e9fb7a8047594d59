"""pagoda-router in front of two real schedulers (dummy workers), all real processes.

What goes through the router comes back as the replica sent it (tokens, errors, the
client's own request_id); a repeated prompt goes back to the replica that cached it; a
replica that stops serving is routed around, and a call it refuses before streaming is
retried on the other; a cancelled stream frees its request on the replica; the stats of
both replicas add up; the bearer key reaches the replicas unchanged.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.protos import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import (
    REPO_ROOT,
    free_port,
    running_service,
    stop_process,
    wait_serving,
    wait_until,
)
from tests.e2e.test_dummy_service import dummy_continuation, request

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 160  # ten blocks of 16: ten routing chunks of token ids


@contextmanager
def running_router(tmp_path: Path, backends: list[str], *args: str) -> Iterator[str]:
    """pagoda-router to `backends`; yields its address once every backend serves there
    (its metrics say so: its own health turns SERVING with the first one)."""
    address = f"127.0.0.1:{free_port()}"
    if "--metrics-address" in args:
        metrics_address = args[args.index("--metrics-address") + 1]
    else:
        metrics_address = f"127.0.0.1:{free_port()}"
        args = (*args, "--metrics-address", metrics_address)
    log_path = tmp_path / f"router-{time.monotonic_ns()}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagoda.router",
                "--listen",
                address,
                "--backends",
                ",".join(backends),
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )  # fmt: skip
    try:
        wait_serving(address, [process])
        wait_until(
            lambda: metric(metrics_address, "pagoda_router_backend_serving") == len(backends),
            60,
            "every backend to serve through the router",
        )
        yield address
    except BaseException:
        print(log_path.read_text()[-4000:])
        raise
    finally:
        assert stop_process(process) == 0


def prompt(seed: int) -> list[int]:
    return [(31 * seed + 7 * j) % 4000 + 10 for j in range(PROMPT_TOKENS)]


async def generate(address: str, prompt_ids: list[int], **fields):
    """(tokens, last response) of one Generate through `address`, over a connection of its
    own (channels of one process share connections unless told not to)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        message = request(prompt_ids, 8)
        for name, value in fields.items():
            setattr(message, name, value)
        responses = [r async for r in stub.Generate(message, timeout=60)]
    return [t for r in responses for t in r.token_ids], responses[-1]


def stats(address: str) -> generation_pb2.ServerStats:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return stub.GetServerStats(generation_pb2.ServerStatsRequest(), timeout=10)


def metric(metrics_address: str, name: str) -> float:
    """The sum of a metric's samples in the router's /metrics."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name + "{"))


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return reply.status


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                running_service(tmp_path_factory.mktemp(f"replica{i}"), model="dummy")
            )
            for i in range(2)
        ]


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    with running_router(
        tmp_path_factory.mktemp("router"), [r.address for r in replicas]
    ) as address:
        yield address


def test_tokens_and_refusals_come_back_as_the_replica_sent_them(router):
    tokens, last = asyncio.run(generate(router, prompt(1)))
    assert tokens == dummy_continuation(prompt(1), 8)
    assert last.finish_reason == generation_pb2.LENGTH
    assert last.usage.prompt_tokens == PROMPT_TOKENS

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(generate(router, prompt(1), priority=0, logprobs=10_000))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logprobs" in refused.value.details()


def test_the_other_calls_are_forwarded_whatever_their_name(router):
    """Tokenize, Detokenize and GetModelInfo reach a replica; a method no replica has is
    the replica's own UNIMPLEMENTED."""
    with grpc.insecure_channel(router) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        ids = stub.Tokenize(generation_pb2.TokenizeRequest(text="Hello world"), timeout=10)
        text = stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=ids.token_ids))
        assert text.text == "Hello world"
        assert stub.GetModelInfo(generation_pb2.ModelInfoRequest(), timeout=10).vocab_size
        missing = channel.unary_unary("/pagoda.v1.Generation/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as refused:
            missing(b"", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_repeated_prompt_goes_back_to_the_replica_that_cached_it(router, replicas):
    """Twelve prompts, each sent twice (one after the other): every repeat finds its whole
    prompt but the last partial block cached, so it went where the first went; and the
    first copies were spread over both replicas."""
    before = [stats(r.address).num_requests_finished for r in replicas]
    seeds = range(100, 112)
    for seed in seeds:
        _, first = asyncio.run(generate(router, prompt(seed)))
        _, again = asyncio.run(generate(router, prompt(seed)))
        assert first.usage.cached_prompt_tokens == 0
        assert again.usage.cached_prompt_tokens >= PROMPT_TOKENS - 16
    served = [
        stats(r.address).num_requests_finished - b for r, b in zip(replicas, before, strict=True)
    ]
    assert sum(served) == 2 * len(seeds)
    assert min(served) >= 2 * 3  # neither replica got all of them


def test_round_robin_loses_the_repeats_that_cache_aware_keeps(replicas, tmp_path):
    """The comparison the policy exists for: the same sequence through a round-robin router
    finds a repeat cached only when it lands where its first copy went."""
    addresses = [r.address for r in replicas]
    with running_router(tmp_path, addresses, "--policy", "round-robin") as address:
        cached = []
        for seed in range(200, 206):
            asyncio.run(generate(address, prompt(seed)))
            _, again = asyncio.run(generate(address, prompt(seed)))
            cached.append(again.usage.cached_prompt_tokens)
    # Two replicas taken in turn: each repeat lands on the other replica than its first.
    assert cached == [0] * 6


def test_two_clients_may_use_the_same_request_id_at_once(router):
    """Both reach a replica through the router's one connection; the router scopes the id
    by client, and each client reads back its own."""

    async def both():
        return await asyncio.gather(
            generate(router, prompt(300), request_id="same"),
            generate(router, prompt(300), request_id="same"),
        )

    for tokens, last in asyncio.run(both()):
        assert tokens == dummy_continuation(prompt(300), 8)
        assert last.request_id == "same"


def test_a_cancelled_stream_frees_its_request_on_the_replica(router, replicas):
    async def cancel_midway():
        async with grpc.aio.insecure_channel(router) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            call = stub.Generate(request(prompt(400), 1_000_000 // PROMPT_TOKENS))
            async for _ in call:
                break  # one message arrived: the request runs on a replica
            running = sum(stats(r.address).num_running for r in replicas)
            call.cancel()
            return running

    assert asyncio.run(cancel_midway()) == 1
    wait_until(
        lambda: sum(stats(r.address).num_running for r in replicas) == 0,
        30,
        "the replica to drop the cancelled request",
    )


def test_stats_add_up_over_the_replicas(router, replicas):
    total = stats(router)
    each = [stats(r.address) for r in replicas]
    assert total.num_kv_blocks_total == sum(s.num_kv_blocks_total for s in each)
    assert total.num_requests_finished == sum(s.num_requests_finished for s in each)
    assert len(total.workers) == 2
    assert total.worker_connected


def test_a_replica_that_stops_serving_is_routed_around(tmp_path):
    with ExitStack() as stack:
        replicas = []
        for i in range(2):
            (tmp_path / f"r{i}").mkdir()
            replicas.append(stack.enter_context(running_service(tmp_path / f"r{i}", model="dummy")))
        address = stack.enter_context(running_router(tmp_path, [r.address for r in replicas]))
        # The first replica loses its worker: its health says NOT_SERVING, and a call sent
        # there before the router hears it is refused UNAVAILABLE and retried on the other.
        replicas[0].worker.kill()
        replicas[0].worker.wait()
        for seed in range(500, 508):
            tokens, _ = asyncio.run(generate(address, prompt(seed)))
            assert tokens == dummy_continuation(prompt(seed), 8)
        assert health(address) == health_pb2.HealthCheckResponse.SERVING

        replicas[1].worker.kill()
        replicas[1].worker.wait()
        wait_until(
            lambda: health(address) == health_pb2.HealthCheckResponse.NOT_SERVING,
            60,
            "the router to report NOT_SERVING",
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(generate(address, prompt(508)))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no replica" in refused.value.details()

        replicas[0].start_worker()
        wait_until(
            lambda: health(address) == health_pb2.HealthCheckResponse.SERVING,
            60,
            "the router to serve again",
        )
        tokens, _ = asyncio.run(generate(address, prompt(509)))
        assert tokens == dummy_continuation(prompt(509), 8)


def test_the_bearer_key_reaches_the_replicas(tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text("alice:1:key-a\n")
    keys.chmod(0o600)
    with ExitStack() as stack:
        replica = stack.enter_context(
            running_service(tmp_path, model="dummy", scheduler_args=["--api-key-file", str(keys)])
        )
        address = stack.enter_context(running_router(tmp_path, [replica.address]))

        async def call(metadata):
            async with grpc.aio.insecure_channel(address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                replies = stub.Generate(request(prompt(600), 4), metadata=metadata, timeout=60)
                return [t async for r in replies for t in r.token_ids]

        assert asyncio.run(call((("authorization", "Bearer key-a"),))) == dummy_continuation(
            prompt(600), 4
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(call(()))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_streams_a_client_stopped_reading_are_ended_with_its_connection_still_open(tmp_path):
    """A raw HTTP/2 client opens streams through the router and never reads them: the
    router's writes to it stall until its write timeout ends each call (the router's
    requests in flight fall to 0 while that client's connection is still open)."""
    from tests.e2e.test_backpressure import StalledConnection, stalled_request

    metrics_address = f"127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        replica = stack.enter_context(running_service(tmp_path, model="dummy"))
        address = stack.enter_context(
            running_router(
                tmp_path,
                [replica.address],
                "--stream-write-timeout-s",
                "2",
                "--metrics-address",
                metrics_address,
            )  # fmt: skip
        )
        connection = StalledConnection(address)
        stack.callback(connection.close)
        streams = [connection.open_generate(stalled_request(i)) for i in range(4)]

        def in_flight() -> float:
            connection.pump(0.05)
            return metric(metrics_address, "pagoda_router_in_flight_requests")

        wait_until(lambda: in_flight() == 4, 30, "the stalled streams to be routed")
        assert all(stream_id in connection.responded for stream_id in streams)
        wait_until(lambda: in_flight() == 0, 60, "the router to end the stalled calls")


def test_a_call_a_lost_replica_cannot_take_is_retried_on_another(tmp_path):
    """A replica's scheduler is killed between two health checks (30 s apart): the next
    call routed there is refused at connect (UNAVAILABLE, nothing streamed), retried on the
    other replica, and that replica is skipped from then on; no client sees an error."""
    metrics_address = f"127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        replicas = []
        for i in range(2):
            (tmp_path / f"r{i}").mkdir()
            replicas.append(stack.enter_context(running_service(tmp_path / f"r{i}", model="dummy")))
        address = stack.enter_context(
            running_router(
                tmp_path,
                [r.address for r in replicas],
                "--health-interval-s",
                "30",
                "--metrics-address",
                metrics_address,
            )  # fmt: skip
        )
        replicas[0].scheduler.kill()
        replicas[0].scheduler.wait()
        for seed in range(700, 706):
            tokens, _ = asyncio.run(generate(address, prompt(seed)))
            assert tokens == dummy_continuation(prompt(seed), 8)
        assert metric(metrics_address, "pagoda_router_retries_total") == 1
        assert metric(metrics_address, "pagoda_router_backend_serving") == 1


def test_sighup_adds_and_removes_replicas_without_dropping_a_call(tmp_path):
    """The router reads its settings file again on SIGHUP: a replica added there joins
    once serving; a replica removed gets no new call, while the stream it was serving
    finishes whole."""
    with ExitStack() as stack:
        replicas = []
        for i in range(2):
            (tmp_path / f"r{i}").mkdir()
            replicas.append(
                stack.enter_context(
                    running_service(
                        tmp_path / f"r{i}", model="dummy", worker_args=["--dummy-step-ms", "5"]
                    )
                )
            )
        settings = tmp_path / "router.toml"
        settings.write_text(f'backends = "{replicas[0].address}"\n')
        address = f"127.0.0.1:{free_port()}"
        metrics_address = f"127.0.0.1:{free_port()}"
        router = subprocess.Popen(
            [sys.executable, "-m", "pagoda.router", "--listen", address, "--config", str(settings),
             "--metrics-address", metrics_address],
            cwd=REPO_ROOT,
        )  # fmt: skip
        stack.callback(stop_process, router)
        wait_serving(address, [router])
        assert len(stats(address).workers) == 1

        settings.write_text(f'backends = "{replicas[0].address},{replicas[1].address}"\n')
        router.send_signal(signal.SIGHUP)
        wait_until(
            lambda: metric(metrics_address, "pagoda_router_backend_serving") == 2,
            30,
            "the added replica to serve",
        )

        def remove_the_replica_serving_it():
            (holder,) = [r for r in replicas if r.stats().num_running == 1]
            kept = next(r for r in replicas if r is not holder)
            settings.write_text(f'backends = "{kept.address}"\n')
            router.send_signal(signal.SIGHUP)
            wait_until(lambda: len(stats(address).workers) == 1, 30, "the removed replica")
            return holder, kept

        async def long_stream_while_its_replica_is_removed():
            async with grpc.aio.insecure_channel(address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                tokens, removed = [], None
                async for response in stub.Generate(request(prompt(800), 400), timeout=120):
                    tokens.extend(response.token_ids)
                    if removed is None and len(tokens) >= 8:
                        removed = await asyncio.to_thread(remove_the_replica_serving_it)
                return tokens, *removed

        tokens, holder, other = asyncio.run(long_stream_while_its_replica_is_removed())
        assert tokens == dummy_continuation(prompt(800), 400)
        before = holder.stats().num_requests_finished
        for seed in range(801, 805):
            asyncio.run(generate(address, prompt(seed)))
        assert holder.stats().num_requests_finished == before
        assert other.stats().num_requests_finished >= 4


def test_calls_beyond_max_concurrent_rpcs_are_refused_and_others_go_on(tmp_path):
    with ExitStack() as stack:
        replica = stack.enter_context(
            running_service(tmp_path, model="dummy", worker_args=["--dummy-step-ms", "5"])
        )
        address = stack.enter_context(
            running_router(tmp_path, [replica.address], "--max-concurrent-rpcs", "2")
        )

        async def scenario():
            async with grpc.aio.insecure_channel(address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                held = [stub.Generate(request(prompt(900 + i), 2000)) for i in range(2)]
                for call in held:
                    await call.read()  # both handlers run
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Generate(request(prompt(902), 4)).read()
                for call in held:
                    call.cancel()
                return refused.value

        refused = asyncio.run(scenario())
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        def served_once_the_places_are_back() -> bool:
            try:
                tokens, _ = asyncio.run(generate(address, prompt(903)))
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return False
            return tokens == dummy_continuation(prompt(903), 8)

        wait_until(served_once_the_places_are_back, 30, "the cancelled calls' places")
