"""Prometheus metrics of the scheduler, served over HTTP when --metrics-address is set.

Histograms are observed by the step loop as events happen; gauges of the queue and
the KV pool are read from the scheduler at scrape time, so they are never stale.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pagoda.scheduler_svc.core import RequestOutput, SchedulerStats, TenantStats
from pagoda.scheduler_svc.metrics_http import serve_metrics
from pagoda.scheduler_svc.worker_stats import WorkerStats

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STEP_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    5,
)
TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# The worker's busy fraction is reported over this much recent wall time.
BUSY_WINDOW_S = 10.0


class WorkerBusy:
    """How much of the wall time the worker spends inside steps.

    A step's busy time is the worker's own StepResult.total_ms (Engine.step: admit,
    forward, sample, pack); its transport, and the scheduler's planning, encoding and
    applying, are the worker's idle time unless a step is overlapped with them. Recorded
    when the result arrives, so a step that began before the window counts whole in it
    (the fraction is clamped to 1).
    """

    def __init__(
        self, window_s: float = BUSY_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._window_s = window_s
        self._clock = clock
        self._steps: deque[tuple[float, float]] = deque()  # (arrival_s, busy_s) in the window
        self._busy_in_window_s = 0.0
        self._started_s: float | None = None  # when the first recorded step began
        self.total_s = 0.0  # since start, never reset

    def record(self, busy_s: float) -> None:
        now_s = self._clock()
        if self._started_s is None:
            self._started_s = now_s - busy_s
        self._steps.append((now_s, busy_s))
        self._busy_in_window_s += busy_s
        self.total_s += busy_s
        self._expire(now_s)

    def fraction(self) -> float:
        """Busy share of the last window_s (or of the time since the first step), in [0, 1]."""
        if self._started_s is None:
            return 0.0
        now_s = self._clock()
        self._expire(now_s)
        span_s = min(self._window_s, now_s - self._started_s)
        if span_s <= 0:
            return 0.0
        return min(1.0, max(0.0, self._busy_in_window_s / span_s))

    def _expire(self, now_s: float) -> None:
        steps = self._steps
        while steps and steps[0][0] <= now_s - self._window_s:
            self._busy_in_window_s -= steps.popleft()[1]


class _LiveStats(Collector):
    def __init__(
        self,
        stats: Callable[[], SchedulerStats],
        worker_connected: Callable[[], bool],
        worker_busy: WorkerBusy,
    ) -> None:
        self._stats = stats
        self._worker_connected = worker_connected
        self._worker_busy = worker_busy

    def collect(self):
        stats = self._stats()
        values = {
            "pagoda_requests_running": ("Requests being computed", stats.num_running),
            "pagoda_requests_waiting": ("Requests in the waiting queue", stats.num_waiting),
            "pagoda_kv_blocks_used": ("KV blocks owned by requests", stats.num_kv_blocks_used),
            "pagoda_kv_blocks_total": ("KV blocks in the worker's pool", stats.num_kv_blocks_total),
            "pagoda_kv_blocks_cached": (
                "Ownerless KV blocks kept for prefix reuse",
                stats.num_kv_blocks_cached,
            ),
            "pagoda_prefix_cache_query_tokens": (
                "Prompt tokens looked up in the prefix cache",
                stats.num_prefix_queries_tokens,
            ),
            "pagoda_prefix_cache_hit_tokens": (
                "Prompt tokens served from the prefix cache",
                stats.num_prefix_hit_tokens,
            ),
            "pagoda_speculative_draft_tokens": (
                "Drafted tokens fed by n-gram speculation since start",
                stats.num_draft_tokens,
            ),
            "pagoda_speculative_accepted_tokens": (
                "Drafted tokens the model agreed with (kept) since start",
                stats.num_accepted_draft_tokens,
            ),
            "pagoda_preemptions": (
                "Requests preempted for recompute since start",
                stats.num_preemptions,
            ),
            "pagoda_isolated_steps": (
                "Steps that fed one suspect request alone, since start (after a failed or "
                "lost step)",
                stats.num_isolated_steps,
            ),
            "pagoda_worker_connected": (
                "1 when a worker is attached",
                int(self._worker_connected()),
            ),
            "pagoda_worker_busy_fraction": (
                f"Share of the last {BUSY_WINDOW_S:g} s the worker spent inside steps",
                self._worker_busy.fraction(),
            ),
            "pagoda_step_prefill_cap_tokens": (
                "Prompt tokens the last planned step could carry (the token knobs, lowered "
                "by the step budget when decodes were in it)",
                stats.step_prefill_cap_tokens,
            ),
            "pagoda_step_cost_intercept_ms": (
                "The step budget's model of a worker step: fixed milliseconds",
                stats.step_cost_intercept_ms,
            ),
            "pagoda_step_cost_prefill_token_ms": (
                "The step budget's model of a worker step: milliseconds per prompt token",
                stats.step_cost_prefill_ms_per_token,
            ),
            "pagoda_step_cost_decode_seq_ms": (
                "The step budget's model of a worker step: milliseconds per decoding sequence",
                stats.step_cost_decode_ms_per_seq,
            ),
            "pagoda_step_cost_context_token_ms": (
                "The step budget's model of a worker step: milliseconds per token of context "
                "attended (each sequence's, summed)",
                stats.step_cost_context_ms_per_token,
            ),
        }
        for name, (documentation, value) in values.items():
            yield GaugeMetricFamily(name, documentation, value=value)


class _PerWorker(Collector):
    """Gauges of each attached worker, labelled by its incarnation id (several workers,
    one lane each in front.py; one series with one worker)."""

    def __init__(self, workers: Callable[[], list[WorkerStats]]) -> None:
        self._workers = workers

    def collect(self):
        gauges = {
            "num_running": ("pagoda_worker_requests_running", "Requests being computed"),
            "num_waiting": ("pagoda_worker_requests_waiting", "Requests in its waiting queue"),
            "num_kv_blocks_used": ("pagoda_worker_kv_blocks_used", "KV blocks owned by requests"),
            "num_kv_blocks_total": ("pagoda_worker_kv_blocks_total", "KV blocks in its pool"),
            "busy_fraction": (
                "pagoda_worker_busy_fraction_by_worker",
                f"Share of the last {BUSY_WINDOW_S:g} s it spent inside steps",
            ),
            "num_steps": ("pagoda_worker_steps", "Steps planned for it since it attached"),
        }
        workers = self._workers()
        for field, (name, documentation) in gauges.items():
            family = GaugeMetricFamily(name, documentation, labels=["worker"])
            for worker in workers:
                family.add_metric([worker.incarnation_id], getattr(worker, field))
            yield family


class _PerTenant(Collector):
    """Gauges of each tenant, labelled by its name (never its key)."""

    def __init__(self, tenants: Callable[[], list[TenantStats]]) -> None:
        self._tenants = tenants

    def collect(self):
        gauges = {
            "num_waiting": ("pagoda_tenant_requests_waiting", "Its requests queued"),
            "num_running": ("pagoda_tenant_requests_running", "Its requests being computed"),
            "num_served_tokens": (
                "pagoda_tenant_served_tokens",
                "Prompt and generated tokens of its finished requests, since start",
            ),
            "num_preemptions": (
                "pagoda_tenant_preemptions",
                "Its requests preempted for recompute, since start",
            ),
            "num_requests_finished": (
                "pagoda_tenant_requests_finished",
                "Its finished requests, since start",
            ),
        }
        tenants = self._tenants()
        for field, (name, documentation) in gauges.items():
            family = GaugeMetricFamily(name, documentation, labels=["tenant"])
            for tenant in tenants:
                family.add_metric([tenant.tenant], getattr(tenant, field))
            yield family


class Metrics:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.worker_busy = WorkerBusy(clock=clock)
        self.worker_busy_s = Counter(
            "pagoda_worker_busy_seconds",
            "Seconds the worker spent inside steps (StepResult.total_ms)",
            registry=r,
        )
        self.ttft_s = Histogram(
            "pagoda_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.itl_s = Histogram(
            "pagoda_inter_token_latency_seconds",
            "Mean time between generated tokens, per request",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e_s = Histogram(
            "pagoda_request_latency_seconds",
            "Arrival to finish",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_s = Histogram(
            "pagoda_queue_time_seconds",
            "Arrival to first scheduled",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.finished = Counter(
            "pagoda_requests_finished", "Finished requests", ["finish_reason"], registry=r
        )
        self.errors = Counter(
            "pagoda_request_errors",
            "Requests refused or failed, by gRPC code",
            ["code"],
            registry=r,
        )
        self.step_s = Histogram(
            "pagoda_step_seconds", "Step time by part", ["part"], buckets=STEP_BUCKETS_S, registry=r
        )
        self.step_tokens = Histogram(
            "pagoda_step_tokens",
            "Tokens computed per step",
            ["kind"],
            buckets=TOKENS_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter("pagoda_generated_tokens", "Generated tokens", registry=r)
        self.prompt_tokens = Counter(
            "pagoda_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.tenant_ttft_s = Histogram(
            "pagoda_tenant_time_to_first_token_seconds",
            "Arrival to first token, by tenant",
            ["tenant"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )

    def watch(
        self, stats: Callable[[], SchedulerStats], worker_connected: Callable[[], bool]
    ) -> None:
        self.registry.register(_LiveStats(stats, worker_connected, self.worker_busy))

    def watch_workers(self, workers: Callable[[], list[WorkerStats]]) -> None:
        self.registry.register(_PerWorker(workers))

    def watch_tenants(self, tenants: Callable[[], list[TenantStats]]) -> None:
        self.registry.register(_PerTenant(tenants))

    def observe_tenant_finish(self, tenant: str, output: RequestOutput) -> None:
        """The time to first token of a finished request of `tenant` (by the servicer,
        which alone knows the tenant)."""
        usage, timings = output.usage, output.timings
        if timings is not None and usage is not None and usage.completion_tokens > 0:
            self.tenant_ttft_s.labels(tenant).observe(timings.first_token_ms / 1000)

    def tenant_ttft(self, tenant: str) -> tuple[list[float], list[int], float]:
        """(upper bounds in s, cumulative counts, sum in s) of `tenant`'s TTFT histogram."""
        bounds: list[float] = []
        counts: list[int] = []
        total_s = 0.0
        for family in self.tenant_ttft_s.collect():
            for sample in family.samples:
                if sample.labels.get("tenant") != tenant:
                    continue
                if sample.name.endswith("_bucket"):
                    bounds.append(float(sample.labels["le"]))
                    counts.append(int(sample.value))
                elif sample.name.endswith("_sum"):
                    total_s = sample.value
        return bounds, counts, total_s

    async def serve(self, address: str) -> asyncio.Server:
        """/metrics on `address` (a bare :PORT binds 127.0.0.1), on the running loop."""
        host, _, port = address.rpartition(":")
        return await serve_metrics(self.registry, host.strip("[]") or "127.0.0.1", int(port))

    def observe_step(
        self,
        *,
        schedule_s: float,
        transport_s: float,
        forward_s: float,
        worker_s: float,
        num_prefill_tokens: int,
        num_decode_tokens: int,
    ) -> None:
        """`worker_s`: the worker's whole time in the step (its total_ms), busy time."""
        self.worker_busy.record(worker_s)
        self.worker_busy_s.inc(worker_s)
        self.step_s.labels("schedule").observe(schedule_s)
        self.step_s.labels("transport").observe(transport_s)
        self.step_s.labels("forward").observe(forward_s)
        self.step_tokens.labels("prefill").observe(num_prefill_tokens)
        self.step_tokens.labels("decode").observe(num_decode_tokens)

    def observe_finish(self, output: RequestOutput) -> None:
        assert output.finish_reason is not None
        self.finished.labels(output.finish_reason.name.lower()).inc()
        usage, timings = output.usage, output.timings
        if usage is not None:
            self.generated_tokens.inc(usage.completion_tokens)
            self.prompt_tokens.inc(usage.prompt_tokens)
        if timings is None:
            return
        self.e2e_s.observe(timings.total_ms / 1000)
        self.queue_s.observe(timings.queued_ms / 1000)
        if usage is not None and usage.completion_tokens > 0:
            self.ttft_s.observe(timings.first_token_ms / 1000)
            if usage.completion_tokens > 1:
                decode_ms = timings.total_ms - timings.first_token_ms
                self.itl_s.observe(decode_ms / 1000 / (usage.completion_tokens - 1))

    def observe_error(self, code: str) -> None:
        self.errors.labels(code).inc()
