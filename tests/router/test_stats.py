"""GetServerStats through the router: the replicas' answers added up."""

from __future__ import annotations

import pytest

from pagoda.protos import generation_pb2 as pb
from pagoda.router.stats import merge_stats


def tenant(name: str, finished: int, counts: list[int]) -> pb.TenantStats:
    return pb.TenantStats(
        tenant=name,
        num_requests_finished=finished,
        ttft_bucket_le_s=[0.1, 1.0, float("inf")],
        ttft_bucket_counts=counts,
        ttft_sum_s=0.5 * finished,
    )


def test_counts_add_and_the_hit_rate_is_one_of_the_sums():
    a = pb.ServerStats(
        num_running=2,
        num_kv_blocks_total=100,
        num_requests_finished=30,
        num_prefix_queried_tokens=1000,
        num_prefix_hit_tokens=900,
        worker_connected=True,
        worker_busy_fraction=0.8,
        workers=[pb.WorkerStats(incarnation_id="wa")],
        tenants=[tenant("alice", 3, [1, 2, 3])],
    )
    b = pb.ServerStats(
        num_running=1,
        num_kv_blocks_total=50,
        num_requests_finished=10,
        num_prefix_queried_tokens=3000,
        num_prefix_hit_tokens=300,
        worker_busy_fraction=0.2,
        workers=[pb.WorkerStats(incarnation_id="wb")],
        tenants=[tenant("alice", 1, [0, 1, 1])],
    )
    total = pb.ServerStats.FromString(merge_stats([a.SerializeToString(), b.SerializeToString()]))
    assert (total.num_running, total.num_kv_blocks_total, total.num_requests_finished) == (
        3,
        150,
        40,
    )
    assert total.prefix_cache_hit_rate == pytest.approx((900 + 300) / (1000 + 3000))
    assert total.worker_busy_fraction == pytest.approx(0.5)
    assert total.worker_connected
    assert [w.incarnation_id for w in total.workers] == ["wa", "wb"]
    (alice,) = total.tenants
    assert (alice.num_requests_finished, list(alice.ttft_bucket_counts)) == (4, [1, 3, 4])
    assert alice.ttft_sum_s == pytest.approx(2.0)
