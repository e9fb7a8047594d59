"""GetServerStats through the router: every replica's answer added up, so `pagoda stats`
and dashboards see the deployment as one server.

Counts and totals add; `workers` lists every replica's workers; the caller's tenant entry
is the sum of its entries (histograms bucket by bucket). `prefix_cache_hit_rate` is the
summed hit tokens over the summed looked-up tokens, `worker_busy_fraction` the replicas'
mean; `worker_connected` and `draining` hold when they hold for any replica.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.protos import generation_pb2

_SUMMED = (
    "num_waiting",
    "num_running",
    "num_kv_blocks_used",
    "num_kv_blocks_total",
    "num_preemptions",
    "num_steps",
    "num_kv_blocks_cached",
    "num_requests_finished",
    "num_generated_tokens",
    "worker_busy_s",
    "num_isolated_steps",
    "num_prefix_queried_tokens",
    "num_prefix_hit_tokens",
    "num_draft_tokens",
    "num_accepted_draft_tokens",
)
_TENANT_SUMMED = (
    "num_waiting",
    "num_running",
    "num_served_tokens",
    "num_preemptions",
    "num_requests_finished",
    "ttft_sum_s",
)


def merge_stats(answers: Sequence[bytes]) -> bytes:
    replies = [generation_pb2.ServerStats.FromString(answer) for answer in answers]
    total = generation_pb2.ServerStats()
    for name in _SUMMED:
        setattr(total, name, sum(getattr(reply, name) for reply in replies))
    total.worker_connected = any(reply.worker_connected for reply in replies)
    total.draining = any(reply.draining for reply in replies)
    total.worker_busy_fraction = sum(r.worker_busy_fraction for r in replies) / len(replies)
    queried = total.num_prefix_queried_tokens
    total.prefix_cache_hit_rate = total.num_prefix_hit_tokens / queried if queried else 0.0
    total.worker_incarnation_id = next(
        (r.worker_incarnation_id for r in replies if r.worker_incarnation_id), ""
    )
    for reply in replies:
        total.workers.extend(reply.workers)
    tenants: dict[str, generation_pb2.TenantStats] = {}
    for reply in replies:
        for entry in reply.tenants:
            merged = tenants.get(entry.tenant)
            if merged is None:
                tenants[entry.tenant] = merged = generation_pb2.TenantStats()
                merged.CopyFrom(entry)
                continue
            _add_tenant(merged, entry)
    total.tenants.extend(tenants.values())
    return total.SerializeToString()


def _add_tenant(merged: generation_pb2.TenantStats, entry: generation_pb2.TenantStats) -> None:
    for name in _TENANT_SUMMED:
        setattr(merged, name, getattr(merged, name) + getattr(entry, name))
    if list(merged.ttft_bucket_le_s) == list(entry.ttft_bucket_le_s):
        counts = [
            a + b for a, b in zip(merged.ttft_bucket_counts, entry.ttft_bucket_counts, strict=True)
        ]
        merged.ttft_bucket_counts[:] = counts
