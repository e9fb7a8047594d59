"""Operator-facing surfaces on real processes: metrics, bearer auth, TLS, --print-config."""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.protos import generation_pb2, generation_pb2_grpc
from tests.conftest import self_signed_certificate
from tests.e2e.conftest import free_port, running_service, wait_until
from tests.e2e.test_dummy_service import request

pytestmark = pytest.mark.slow


def test_prometheus_metrics_are_scraped(tmp_path):
    metrics_address = f"127.0.0.1:{free_port()}"
    with running_service(
        tmp_path, model="dummy", scheduler_args=["--metrics-address", metrics_address]
    ) as service:
        with service.channel() as channel:
            stub = service.stub(channel)
            for _ in range(3):
                list(stub.Generate(request([5, 6, 7, 8], 8), timeout=30))
            refused = generation_pb2.GenerateRequest(
                prompt="hi", sampling=generation_pb2.SamplingParams(top_p=2.0)
            )
            with pytest.raises(grpc.RpcError):
                list(stub.Generate(refused, timeout=30))
            stats = stub.GetServerStats(generation_pb2.ServerStatsRequest(), timeout=10)
            assert stats.worker_busy_s > 0 and 0 < stats.worker_busy_fraction <= 1
        body = (
            urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
        )
    for name in (
        "pagoda_time_to_first_token_seconds_bucket",
        "pagoda_inter_token_latency_seconds_count",
        "pagoda_request_latency_seconds_count",
        "pagoda_queue_time_seconds_count",
        "pagoda_requests_running",
        "pagoda_requests_waiting",
        "pagoda_kv_blocks_used",
        "pagoda_kv_blocks_total",
        "pagoda_prefix_cache_query_tokens",
        "pagoda_prefix_cache_hit_tokens",
        "pagoda_preemptions",
        "pagoda_isolated_steps",
        'pagoda_step_seconds_count{part="forward"}',
        'pagoda_step_seconds_count{part="transport"}',
        'pagoda_step_seconds_count{part="schedule"}',
        'pagoda_step_tokens_count{kind="decode"}',
        "pagoda_worker_busy_fraction",
        "pagoda_worker_busy_seconds_total",
    ):
        assert name in body, name
    assert 'pagoda_requests_finished_total{finish_reason="length"} 3.0' in body
    assert 'pagoda_request_errors_total{code="INVALID_ARGUMENT"} 1.0' in body
    assert 'pagoda_step_tokens_count{kind="prefill"}' in body
    assert "pagoda_worker_connected 1.0" in body


def test_bearer_token_is_required_when_configured(tmp_path):
    key_file = tmp_path / "api.key"
    key_file.write_text("s3cret-token\n")
    with (
        running_service(
            tmp_path, model="dummy", scheduler_args=["--api-key-file", str(key_file)]
        ) as service,
        service.channel() as channel,
    ):
        stub = service.stub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(request([5, 6], 2), timeout=10, metadata=metadata))
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as caught:
            stub.GetServerStats(generation_pb2.ServerStatsRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", "Bearer s3cret-token"),)
        responses = list(stub.Generate(request([5, 6], 2), timeout=10, metadata=good))
        assert responses[-1].finish_reason == generation_pb2.LENGTH


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_serves_clients_that_trust_the_certificate(tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    args = ["--tls-cert", str(cert), "--tls-key", str(key)]
    with running_service(
        tmp_path, model="dummy", scheduler_args=args, plaintext_health=False
    ) as service:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(service.address, credentials) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            serving = health_pb2.HealthCheckResponse.SERVING

            def ready() -> bool:
                try:
                    reply = health.Check(
                        health_pb2.HealthCheckRequest(), timeout=1, wait_for_ready=True
                    )
                except grpc.RpcError:
                    return False
                return reply.status == serving

            wait_until(ready, 60, "SERVING over TLS")
            stub = generation_pb2_grpc.GenerationStub(channel)
            responses = list(stub.Generate(request([5, 6], 3), timeout=30))
            assert responses[-1].finish_reason == generation_pb2.LENGTH


def test_print_config_shows_values_and_sources():
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.scheduler_svc", "--print-config", "--admission-policy", "pack"],
        capture_output=True, text=True, env={"PAGODA_MAX_ACTIVE_REQUESTS": "12", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert 'admission_policy = "pack"' in result.stdout and "# flag" in result.stdout
    assert (
        "max_active_requests = 12" in result.stdout
        and "# env PAGODA_MAX_ACTIVE_REQUESTS" in result.stdout
    )


def test_bad_configuration_stops_with_a_sentence():
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.scheduler_svc", "--max-num-batched-tokens", "0"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "max_num_batched_tokens must be >= 1" in result.stderr
