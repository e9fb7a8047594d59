"""--access-log end to end: a real scheduler (dummy worker) writes one JSON line per call,
with the client's request_id, the trace id of its traceparent, the status and the tokens;
a refused call and a cancelled one get theirs too."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from pagoda.protos import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import running_service, wait_until
from tests.e2e.test_dummy_service import request

pytestmark = pytest.mark.slow

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def access_lines(log_text: str) -> list[dict]:
    lines = [json.loads(line) for line in log_text.splitlines() if line.startswith("{")]
    return [line for line in lines if line["logger"] == "pagoda.access"]


def test_each_call_gets_one_line_with_its_trace_status_and_tokens(tmp_path):
    args = ["--access-log", "--log-format", "json"]
    slow = ["--dummy-step-ms", "5"]  # the third call is still running when it is cancelled
    with running_service(tmp_path, model="dummy", scheduler_args=args, worker_args=slow) as service:

        async def calls():
            async with grpc.aio.insecure_channel(service.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                served = request([5, 6, 7], 4)
                served.request_id = "traced"
                metadata = (("traceparent", TRACEPARENT),)
                _ = [r async for r in stub.Generate(served, metadata=metadata, timeout=30)]
                with pytest.raises(grpc.aio.AioRpcError):
                    _ = [r async for r in stub.Generate(generation_pb2.GenerateRequest())]
                call = stub.Generate(request([8, 9], 2000), timeout=30)
                async for _ in call:
                    break
                call.cancel()

        asyncio.run(calls())
        log_path = tmp_path / "scheduler.log"
        wait_until(lambda: len(access_lines(log_path.read_text())) >= 3, 30, "three lines")
        served, refused, cancelled = access_lines(log_path.read_text())
    assert (served["request_id"], served["trace_id"], served["status"]) == (
        "traced",
        TRACE_ID,
        "OK",
    )
    assert (served["method"], served["finish_reasons"]) == ("Generate", "LENGTH")
    assert (served["prompt_tokens"], served["completion_tokens"]) == (3, 4)
    assert served["tenant"] and served["peer"].startswith("ipv4:127.0.0.1:")
    assert served["first_token_ms"] is not None and served["total_ms"] >= 0
    assert (refused["status"], refused["completion_tokens"]) == ("INVALID_ARGUMENT", 0)
    assert cancelled["status"] == "CANCELLED"
