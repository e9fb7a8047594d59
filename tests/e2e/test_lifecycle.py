"""Health, worker loss past the grace period, drain past its timeout, transport limits and
the scheduler's log lines, on real processes with the dummy worker."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.protos import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import REPO_ROOT, free_port, running_service, stop_process, wait_until
from tests.e2e.test_dummy_service import dummy_continuation, prompts, request, stream_tokens

pytestmark = pytest.mark.slow
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str) -> int | None:
    """The overall health status, or None while the server does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
        except grpc.RpcError:
            return None
        return reply.status


async def read_until_end(call, tokens: list[int]) -> tuple[list[int], int, grpc.StatusCode]:
    """Tokens (after those already read), finish reason and status code of a stream,
    whichever way it ends."""
    finish = 0
    try:
        while (response := await call.read()) is not grpc.aio.EOF:
            tokens.extend(response.token_ids)
            finish = response.finish_reason or finish
    except grpc.RpcError as exc:
        return tokens, finish, exc.code()
    return tokens, finish, grpc.StatusCode.OK


async def streams_around(address: str, batch: list[list[int]], intervene, timeout_s: float = 120):
    """Open one 8,000-token stream per prompt, wait for the first one's first message and
    for the server to hold every request, run `intervene()` (blocking, in a thread), then
    read every stream to its end."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = [stub.Generate(request(p, 8000), timeout=timeout_s) for p in batch]
        first = await calls[0].read()  # streams are flowing
        # Queued requests send nothing yet: only the server's counts say all have arrived
        # (one still in flight when the intervention is a drain would be refused).
        deadline = asyncio.get_running_loop().time() + 60
        while True:
            stats = await stub.GetServerStats(generation_pb2.ServerStatsRequest(), timeout=10)
            if stats.num_waiting + stats.num_running + stats.num_requests_finished >= len(batch):
                break
            assert asyncio.get_running_loop().time() < deadline, "requests never all arrived"
            await asyncio.sleep(0.05)
        await asyncio.to_thread(intervene)
        return await asyncio.gather(
            *(read_until_end(c, list(first.token_ids) if i == 0 else [])
              for i, c in enumerate(calls))
        )  # fmt: skip


def test_health_follows_the_worker(tmp_path):
    endpoint = f"ipc://{tmp_path}/w.sock"
    address = f"127.0.0.1:{free_port()}"
    log_file = open(tmp_path / "scheduler.log", "w")  # noqa: SIM115 (closed below)
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "pagoda.scheduler_svc", "--grpc-address", address,
         "--zmq-endpoint", endpoint, "--worker-grace-s", "60"],
        cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT,
    )  # fmt: skip
    worker = None
    try:
        assert wait_until(lambda: health(address), 60, "the health service") == NOT_SERVING
        worker = subprocess.Popen(
            [sys.executable, "-m", "pagoda.gpu_worker", "--model", "dummy", "--zmq-endpoint", endpoint],
            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_until(lambda: health(address) == SERVING, 60, "SERVING once a worker said hello")
        worker.kill()
        worker.wait()
        wait_until(lambda: health(address) == NOT_SERVING, 60, "NOT_SERVING without a worker")
    finally:
        stop_process(worker)
        stop_process(scheduler)
        log_file.close()


def test_streams_in_flight_end_unavailable_when_no_worker_returns(tmp_path):
    with running_service(
        tmp_path,
        model="dummy",
        scheduler_args=[
            "--worker-grace-s",
            "1",
            "--worker-timeout-s",
            "3",
            "--max-active-requests",
            "2",
        ],
    ) as service:
        batch = prompts(6)
        results = asyncio.run(streams_around(service.address, batch, lambda: service.worker.kill()))
        codes = [code for _, _, code in results]
        assert grpc.StatusCode.UNAVAILABLE in codes  # 6 x 8,000 tokens outlast the kill
        for prompt_ids, (tokens, finish, code) in zip(batch, results, strict=True):
            if code == grpc.StatusCode.OK:
                assert finish == generation_pb2.LENGTH and len(tokens) == 8000
            else:
                assert code == grpc.StatusCode.UNAVAILABLE
            # Whatever arrived before the loss is exactly the start of the right output.
            assert tokens == dummy_continuation(prompt_ids, len(tokens))
        assert "no worker came back within 1 s" in (tmp_path / "scheduler.log").read_text()


def test_drain_turns_health_off_and_cancels_what_outlives_the_timeout(tmp_path):
    with running_service(
        tmp_path,
        model="dummy",
        scheduler_args=["--drain-timeout-s", "1", "--max-active-requests", "1"],
    ) as service:
        batch = prompts(12)

        def drain() -> None:
            service.scheduler.send_signal(signal.SIGTERM)
            wait_until(
                lambda: health(service.address) in (NOT_SERVING, None),
                30,
                "NOT_SERVING while draining",
            )

        results = asyncio.run(streams_around(service.address, batch, drain))
        finishes = [finish for _, finish, _ in results]
        # One request runs at a time and each needs 8,000 tokens: most outlive the drain.
        assert generation_pb2.CANCELLED in finishes
        for prompt_ids, (tokens, finish, code) in zip(batch, results, strict=True):
            assert code == grpc.StatusCode.OK
            assert finish in (generation_pb2.LENGTH, generation_pb2.CANCELLED)
            assert tokens == dummy_continuation(prompt_ids, len(tokens))
        assert service.scheduler.wait(timeout=60) == 0
        assert "cancelling" in (tmp_path / "scheduler.log").read_text()


def test_grpc_message_and_stream_limits(tmp_path):
    with running_service(
        tmp_path,
        model="dummy",
        scheduler_args=["--max-grpc-message-bytes", "65536", "--max-concurrent-streams", "2"],
    ) as service:
        with service.channel() as channel, pytest.raises(grpc.RpcError) as caught:
            list(service.stub(channel).Generate(
                generation_pb2.GenerateRequest(prompt="x" * 70_000), timeout=30
            ))  # fmt: skip
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        async def scenario():
            events: list[tuple[str, int]] = []

            async def stream(index: int, prompt_ids: list[int]) -> None:
                call = stub.Generate(request(prompt_ids, 300), timeout=60)
                async for _ in call:
                    if not events or events[-1] != ("token", index):
                        events.append(("token", index))
                events.append(("end", index))

            async with grpc.aio.insecure_channel(service.address) as channel:
                # Connected first, so the server's SETTINGS (its stream limit) are known
                # before the client opens any stream.
                await channel.channel_ready()
                stub = generation_pb2_grpc.GenerationStub(channel)
                await asyncio.gather(*(stream(i, p) for i, p in enumerate(prompts(3))))
            return events

        events = asyncio.run(scenario())
        # Two streams per connection: the third one's first token comes after an end.
        first_of_third = min(i for i, (kind, index) in enumerate(events) if index == 2)
        assert any(kind == "end" for kind, _ in events[:first_of_third])


def test_one_log_line_per_request_and_a_periodic_status(tmp_path):
    with running_service(
        tmp_path, model="dummy", scheduler_args=["--status-interval-s", "0.2"]
    ) as service:

        async def scenario():
            async with grpc.aio.insecure_channel(service.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                return await stream_tokens(stub, [5, 6, 7, 8], 2000)

        tokens, _ = asyncio.run(scenario())
        assert len(tokens) == 2000
        log_text = lambda: (tmp_path / "scheduler.log").read_text()  # noqa: E731
        wait_until(lambda: "length: prompt 4 tokens (0 cached), 2000 generated" in log_text(),
                   30, "the request's log line")  # fmt: skip
        assert "TTFT" in log_text()
        wait_until(lambda: "status: " in log_text(), 30, "a status line")


def streams_finish_exactly_across(tmp_path, intervene) -> None:
    """Four 8,000-token streams with a 10-minute result timeout; `intervene(service)` runs
    once they flow, loses the worker and brings one back. The scheduler must have learnt of
    the loss from the transport (not waited for the timeout), and every stream ends as if
    nothing had happened.

    The transport tells it one of two ways, whichever comes first: the monitor's disconnect
    event ("its connection closed"), or a plan sent to a peer whose pipe is already gone
    ("cannot reach the worker"); CI saw the second once on a loaded machine."""
    with running_service(
        tmp_path,
        model="dummy",
        scheduler_args=["--worker-timeout-s", "600", "--max-active-requests", "2"],
    ) as service:
        batch = prompts(4)
        results = asyncio.run(
            streams_around(service.address, batch, lambda: intervene(service), 300)
        )
        for prompt_ids, (tokens, finish, code) in zip(batch, results, strict=True):
            assert code == grpc.StatusCode.OK and finish == generation_pb2.LENGTH
            assert tokens == dummy_continuation(prompt_ids, 8000)
        log_text = (tmp_path / "scheduler.log").read_text()
        assert re.search(r"lost: (its connection closed|cannot reach the worker)", log_text)
        assert "no result for step" not in log_text


def wait_dropped(service, what: str) -> None:
    wait_until(lambda: not service.stats().worker_connected, 60, what)


def test_a_killed_worker_is_noticed_when_its_connection_closes(tmp_path):
    """The streams pause, then finish exactly on the next worker."""

    def kill_and_replace(service) -> None:
        service.worker.kill()
        wait_dropped(service, "the scheduler to notice the closed connection")
        service.start_worker()

    streams_finish_exactly_across(tmp_path, kill_and_replace)


def test_a_hung_worker_is_dropped_by_transport_heartbeats_and_comes_back(tmp_path):
    """A worker that stops answering without closing its connection (SIGSTOP here; a host
    that vanished looks the same) is dropped when ZeroMQ's heartbeats time out. Resumed,
    the same process re-introduces itself, starts clean, and the streams finish exactly."""

    def hang_then_resume(service) -> None:
        incarnation = service.stats().worker_incarnation_id
        service.worker.send_signal(signal.SIGSTOP)
        try:
            wait_dropped(service, "the scheduler to drop the silent worker")
        finally:
            service.worker.send_signal(signal.SIGCONT)
        wait_until(lambda: service.stats().worker_connected, 60, "the worker to attach again")
        assert service.stats().worker_incarnation_id == incarnation  # the same process

    streams_finish_exactly_across(tmp_path, hang_then_resume)
