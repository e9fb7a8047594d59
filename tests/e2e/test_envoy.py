"""deploy/envoy/envoy.yaml: two replicas behind Envoy (docs/operations.md, "Replicas behind
a load balancer").

The config's promises are checked always (YAML; pyyaml comes with transformers). Where an
`envoy` binary is on PATH, two dummy replicas (scheduler + worker each) run behind a copy of
the config whose ports are free ones: streams succeed through it, and with one replica
stopped new requests are still served.
"""

from __future__ import annotations

import concurrent.futures
import shutil
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
import yaml

from pagoda.common.listener import KEEPALIVE_OPTIONS
from pagoda.protos import generation_pb2, generation_pb2_grpc
from pagoda.scheduler_svc.api import SERVICE_NAME
from tests.e2e.conftest import (
    REPO_ROOT,
    _spawn,
    free_port,
    running_service,
    stop_process,
    wait_until,
)

CONFIG_PATH = REPO_ROOT / "deploy" / "envoy" / "envoy.yaml"
ENVOY = shutil.which("envoy")
NUM_NEW_TOKENS = 8


def load_config() -> dict:
    return yaml.safe_load(CONFIG_PATH.read_text())


def seconds(duration: str) -> float:
    assert duration.endswith("s"), duration
    return float(duration[:-1])


def parts(config: dict) -> tuple[dict, dict, dict]:
    """(the HTTP connection manager, its one route, the replicas' cluster)."""
    (listener,) = config["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (manager,) = [f["typed_config"] for f in chain["filters"]]
    (host,) = manager["route_config"]["virtual_hosts"]
    (route,) = host["routes"]
    (cluster,) = config["static_resources"]["clusters"]
    return manager, route, cluster


def socket_addresses(node) -> list[dict]:
    if isinstance(node, dict):
        found = [node["socket_address"]] if "socket_address" in node else []
        return found + [a for value in node.values() for a in socket_addresses(value)]
    if isinstance(node, list):
        return [a for value in node for a in socket_addresses(value)]
    return []


def test_the_config_health_checks_grpc_and_retries_only_before_a_response():
    config = load_config()
    manager, route, cluster = parts(config)
    # Health: grpc.health.v1 for the Generation service the scheduler registers.
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"]["service_name"] == SERVICE_NAME
    # HTTP/2 both ways.
    assert manager["codec_type"] == "HTTP2"
    http = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    http2 = http["explicit_http_config"]["http2_protocol_options"]
    # Envoy's pings no more often than the scheduler accepts (or it answers GOAWAY).
    min_ping_interval_ms = dict(KEEPALIVE_OPTIONS)["grpc.http2.min_ping_interval_without_data_ms"]
    assert seconds(http2["connection_keepalive"]["interval"]) * 1000 > min_ping_interval_ms
    # Retries: only failures that precede any response byte.
    action = route["route"]
    retry_on = set(action["retry_policy"]["retry_on"].split(","))
    assert retry_on == {"connect-failure", "refused-stream", "unavailable"}
    # Streams: no total timeout, an idle limit instead; least outstanding requests.
    assert action["timeout"] == "0s"
    assert manager["stream_idle_timeout"].endswith("s")
    assert cluster["lb_policy"] == "LEAST_REQUEST"
    # Loopback only: the listener, the admin page, the two replicas.
    addresses = socket_addresses(config)
    assert {a["address"] for a in addresses} == {"127.0.0.1"}
    ports = {a["port_value"] for a in socket_addresses(cluster)}
    assert ports == {50051, 50052}


def config_for(replica_addresses: list[str], listen_port: int, admin_port: int) -> dict:
    """The shipped config with the test's ports."""
    config = load_config()
    config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = (
        listen_port
    )
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    _, _, cluster = parts(config)
    endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert len(endpoints) == len(replica_addresses)
    for endpoint, address in zip(endpoints, replica_addresses, strict=True):
        endpoint["endpoint"]["address"]["socket_address"]["port_value"] = int(
            address.rsplit(":", 1)[1]
        )
    return config


def generate(address: str) -> list[generation_pb2.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(
            prompt_token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]),
            stopping=generation_pb2.StoppingCriteria(
                max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True
            ),
        )
        return list(stub.Generate(request, timeout=30))


def complete(responses) -> bool:
    tokens = [t for r in responses for t in r.token_ids]
    return len(tokens) == NUM_NEW_TOKENS and responses[-1].finish_reason == generation_pb2.LENGTH


def first_success(address: str):
    try:
        return complete(generate(address))
    except grpc.RpcError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(ENVOY is None, reason="no `envoy` binary on PATH (it cannot be installed here)")
def test_streams_pass_through_envoy_and_survive_a_stopped_replica(tmp_path):
    with ExitStack() as stack:
        replicas = []
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            replicas.append(stack.enter_context(running_service(tmp_path / name, model="dummy")))
        listen_port, admin_port = free_port(), free_port()
        config_path = tmp_path / "envoy.yaml"
        config_path.write_text(
            yaml.safe_dump(config_for([r.address for r in replicas], listen_port, admin_port))
        )
        envoy = _spawn(
            [ENVOY, "-c", str(config_path), "--disable-hot-restart", "--log-level", "warn"],
            tmp_path / "envoy.log",
        )
        stack.callback(stop_process, envoy)
        front = f"127.0.0.1:{listen_port}"
        try:
            wait_until(lambda: first_success(front), 60, "a stream through envoy")
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda _: generate(front), range(16)))
            assert all(complete(r) for r in results)
            # One replica gone (scheduler and worker): new requests are still served, by
            # the retry on connect-failure until the health check drops the replica.
            stop_process(replicas[0].scheduler)
            stop_process(replicas[0].worker)
            for _ in range(10):
                assert complete(generate(front))
        except BaseException:
            print(Path(tmp_path / "envoy.log").read_text()[-4000:])
            raise
