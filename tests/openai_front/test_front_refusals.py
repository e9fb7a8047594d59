"""The scheduler's refusals through the front: a full queue is 429, no worker is 503 (not a
404 for a model the scheduler cannot name yet)."""

from __future__ import annotations

import asyncio
import sys

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.conftest import _spawn, free_port, running_service, stop_process, wait_until
from tests.openai_front.conftest import start_front

pytestmark = pytest.mark.slow


def test_a_full_waiting_queue_is_429(tmp_path):
    args = ["--max-active-requests", "1", "--max-waiting-requests", "1"]
    with running_service(
        tmp_path, model="dummy", worker_args=["--dummy-step-ms", "100"], scheduler_args=args
    ) as service:
        process, url = start_front(service.address, tmp_path / "front.log")
        try:
            body = {"prompt": "Hi", "max_tokens": 20, "ignore_eos": True}

            async def send_all() -> list[httpx.Response]:
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    return await asyncio.gather(
                        *(http.post("/v1/completions", json=body) for _ in range(6))
                    )

            responses = asyncio.run(send_all())
            statuses = sorted(r.status_code for r in responses)
            assert 200 in statuses and 429 in statuses, statuses
            refused = next(r for r in responses if r.status_code == 429)
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        finally:
            stop_process(process)


def health_status(address: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1
            )
        except grpc.RpcError:
            return None
        return reply.status


def test_no_worker_yet_is_503_whatever_the_model(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    scheduler = _spawn(
        [sys.executable, "-m", "pagoda.scheduler_svc", "--grpc-address", address,
         "--zmq-endpoint", f"ipc://{tmp_path}/w.sock", "--model", "default"],
        tmp_path / "scheduler.log",
    )  # fmt: skip
    try:
        wait_until(lambda: health_status(address) is not None, 120, "the scheduler to answer")
        assert health_status(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        process, url = start_front(address, tmp_path / "front.log", serving=False)
        try:
            with httpx.Client(base_url=url, timeout=60) as http:
                for model in ("default", "some/other-model"):
                    response = http.post(
                        "/v1/chat/completions",
                        json={"model": model, "messages": [{"role": "user", "content": "Hi"}]},
                    )
                    assert response.status_code == 503, response.text
                    assert response.json()["error"]["code"] == "service_unavailable"
        finally:
            stop_process(process)
    finally:
        stop_process(scheduler)
