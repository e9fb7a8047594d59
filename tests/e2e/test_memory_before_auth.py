"""Refused calls hold no memory (security review N1): large Generates without a token, or
with a token and ids beyond the vocabulary, leave the scheduler's RSS where it was.

Before: each refusal's traceback kept the 4 MiB request in a reference cycle that the tuned
collector (gen0 threshold 100k, about 27 objects per refusal) reached only after thousands
of calls; 1,015 of them took the scheduler past its unit's MemoryMax=4G."""

from __future__ import annotations

import grpc
import pytest

from pagoda.protos import generation_pb2, generation_pb2_grpc
from pagoda.scheduler_svc.settings import ServiceConfig
from tests.e2e.conftest import running_service
from tests.e2e.test_load import rss_bytes

pytestmark = pytest.mark.slow

NUM_CALLS = 300
LARGE_BYTES = 4 * 1024 * 1024 - 64  # the old default cap, just under it
# Beyond the cap grpc refuses a call before any handler, slowly for the client (~0.25 s).
NUM_CALLS_BEYOND_CAP = 30
# 300 refusals of 1-4 MiB each kept about 1.2 GB before; allocator noise is a few MiB.
MAX_RSS_GROWTH_BYTES = 100 * 1024 * 1024
TOKEN = "s3cret-token-0123456789"


def refuse_many(
    stub, request: generation_pb2.GenerateRequest, metadata=(), num_calls: int = NUM_CALLS
) -> set[str]:
    codes = set()
    for _ in range(num_calls):
        with pytest.raises(grpc.RpcError) as caught:
            for _ in stub.Generate(request, timeout=30, metadata=metadata):
                pass
        codes.add(caught.value.code().name)
    return codes


def test_refused_large_calls_leave_no_memory_behind(tmp_path):
    key_file = tmp_path / "api.key"
    key_file.write_text(f"{TOKEN}\n")
    cap_bytes = ServiceConfig().max_grpc_message_bytes
    with (
        running_service(
            tmp_path, model="dummy", scheduler_args=["--api-key-file", str(key_file)]
        ) as service,
        grpc.insecure_channel(
            service.address, options=[("grpc.max_send_message_length", 2 * LARGE_BYTES)]
        ) as channel,
    ):
        stub = generation_pb2_grpc.GenerationStub(channel)
        before = rss_bytes(service.scheduler.pid)
        large = generation_pb2.GenerateRequest(prompt="a" * LARGE_BYTES)
        codes = refuse_many(stub, large, num_calls=NUM_CALLS_BEYOND_CAP)
        assert codes <= {"UNAUTHENTICATED", "RESOURCE_EXHAUSTED"}
        at_cap = generation_pb2.GenerateRequest(prompt="a" * (cap_bytes - 64))
        assert refuse_many(stub, at_cap) == {"UNAUTHENTICATED"}
        # ~5 bytes per id on the wire: a list of ints many times that once parsed.
        ids = generation_pb2.TokenIds(ids=[2**31] * (cap_bytes // 6))
        bad_ids = generation_pb2.GenerateRequest(prompt_token_ids=ids)
        assert bad_ids.ByteSize() < cap_bytes
        codes = refuse_many(stub, bad_ids, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert codes == {"INVALID_ARGUMENT"}
        growth = rss_bytes(service.scheduler.pid) - before
        assert growth < MAX_RSS_GROWTH_BYTES, f"scheduler RSS grew by {growth / 2**20:.0f} MiB"
