"""What the router process loads: grpc and protobuf, and nothing of the model or the step loop."""

from __future__ import annotations

from tests.unit.test_no_torch import loaded


def test_the_router_loads_neither_torch_nor_the_scheduler_service():
    """A router host needs grpc and protobuf only: no torch, no tokenizer, no step loop."""
    forbidden = ["torch", "transformers", "tokenizers", "zmq", "pagoda.scheduler_svc.api"]
    assert loaded(["pagoda.router.__main__"], forbidden) == ""


def test_the_routing_policy_and_the_index_are_pure():
    modules = ["pagoda.router.policy", "pagoda.router.prefix_index"]
    assert loaded(modules, ["grpc", "asyncio", "google.protobuf"]) == ""
