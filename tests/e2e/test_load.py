"""1,000 concurrent streams against the dummy worker: all complete, no memory is kept."""

from __future__ import annotations

import asyncio
import gc

import pytest

from pagoda.protos import generation_pb2
from tests.e2e.conftest import running_service, wait_until
from tests.e2e.test_dummy_service import dummy_continuation, many_streams, prompts

pytestmark = pytest.mark.slow

NUM_STREAMS = 1000
# Allocator noise after a run that already warmed every code path and pool.
MAX_RSS_GROWTH_BYTES = 24 * 1024 * 1024


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_thousand_concurrent_streams_complete_and_leave_no_memory_behind(tmp_path):
    with running_service(
        tmp_path,
        model="dummy",
        worker_args=["--num-kv-blocks", "8192"],
        scheduler_args=["--max-active-requests", "512", "--max-num-batched-tokens", "4096"],
    ) as service:
        batch = prompts(NUM_STREAMS, length=24)

        def run_once() -> None:
            results = asyncio.run(many_streams(service.address, batch, 16))
            for prompt_ids, (tokens, finish) in zip(batch, results, strict=True):
                assert finish == generation_pb2.LENGTH
                assert tokens == dummy_continuation(prompt_ids, 16)
            wait_until(
                lambda: (
                    (s := service.stats()).num_running == 0
                    and s.num_waiting == 0
                    and s.num_kv_blocks_used == 0
                ),
                60,
                "every stream to be gone",
            )

        run_once()  # warms pools, caches and the allocator
        gc.collect()
        idle_after_warmup = rss_bytes(service.scheduler.pid)
        run_once()
        run_once()
        growth = rss_bytes(service.scheduler.pid) - idle_after_warmup
        assert growth < MAX_RSS_GROWTH_BYTES, f"scheduler RSS grew by {growth / 2**20:.1f} MiB"
