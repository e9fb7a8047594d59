"""What a refused request costs (security review N1): no reference cycle keeps it, a quiet
server's collector still frees cycles, and the default request cap is near what a legal
request needs. The live attack is tests/e2e/test_memory_before_auth.py."""

from __future__ import annotations

import asyncio
import gc
import platform
import weakref

import grpc
import pytest

from pagoda.protos import generation_pb2 as pb
from pagoda.scheduler_svc.core import QueueFullError
from pagoda.scheduler_svc.gc_tuning import GEN0_THRESHOLD, collect_young_if_quiet, malloc_trim
from pagoda.scheduler_svc.settings import ServiceConfig
from tests.unit.test_api_admission import Aborted, Context, FakeLoop, servicer

# The longest prompt the default cap must hold: a 128k context, ids up to 2**21 - 1.
LONG_CONTEXT_TOKENS = 131_072


def garbage_holding(requests: list) -> list[str]:
    """What the cyclic collector finds (and so reference counting missed) that refers to
    one of `requests`: frames, by function name."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        holders = [
            getattr(getattr(item, "f_code", None), "co_name", type(item).__name__)
            for item in gc.garbage
            if any(
                referent is request for referent in gc.get_referents(item) for request in requests
            )
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return holders


class QueueFullLoop(FakeLoop):
    def submit(self, valid):
        raise QueueFullError("the waiting queue is full")


def test_refused_requests_are_freed_by_reference_counting_alone():
    service, _, _ = servicer()
    bad_ids = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[10**6] * 100))
    bad_role = pb.ChatRequest(messages=[pb.ChatMessage(role="x" * 40, content="hi")])
    too_long = pb.TokenizeRequest(text="a" * 4_000_000)
    queue_full = pb.GenerateRequest(prompt="hello")
    full_service, _, _ = servicer()
    full_service._front = QueueFullLoop(num_waiting=0)

    async def scenario() -> list[grpc.StatusCode | None]:
        calls = [
            (service.Generate, bad_ids),
            (service.Chat, bad_role),
            (service.Tokenize, too_long),
            (full_service.Generate, queue_full),
        ]
        codes = []
        for method, request in calls:
            context = Context()  # dropped after the call, as grpc.aio drops its own
            try:
                await method(request, context)
            except Aborted:  # how the code before answered: context.abort raised
                pass
            codes.append(context.code)
        return codes

    gc.collect()
    gc.disable()
    try:
        codes = asyncio.run(scenario())
        assert garbage_holding([bad_ids, bad_role, too_long, queue_full]) == []
    finally:
        gc.enable()
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 3 + [grpc.StatusCode.RESOURCE_EXHAUSTED]


def test_a_quiet_server_collects_its_young_cycles():
    class Node:
        pass

    threshold = gc.get_threshold()
    gc.collect()
    gc.set_threshold(GEN0_THRESHOLD, 50, 100)
    try:
        node = Node()
        node.self = node
        freed = weakref.ref(node)
        del node
        # A collection ran since the last look (here: any count but the current one): a
        # busy server, which collects on its own; nothing is done.
        num_seen = collect_young_if_quiet(-1)
        assert freed() is not None
        collect_young_if_quiet(num_seen)  # nothing ran since: quiet, so it collects
        assert freed() is None
    finally:
        gc.set_threshold(*threshold)


def test_the_default_request_cap_holds_a_prompt_of_a_long_context():
    cap_bytes = ServiceConfig().max_grpc_message_bytes
    assert cap_bytes <= 2 * 1024 * 1024  # near what a legal request needs
    ids = pb.TokenIds(ids=[2**21 - 1] * (LONG_CONTEXT_TOKENS - 1))
    stopping = pb.StoppingCriteria(stop=["s" * 256] * 16, stop_token_ids=range(64))
    by_ids = pb.GenerateRequest(
        prompt_token_ids=ids, stopping=stopping, request_id="r" * 128, cache_salt="c" * 256
    )
    assert by_ids.ByteSize() <= cap_bytes
    # Text: about 4.5 bytes per token in English under a BPE vocabulary.
    text = "word " * (LONG_CONTEXT_TOKENS - 1)
    message = pb.ChatMessage(role="user", content=text)
    chat = pb.ChatRequest(messages=[message], stopping=stopping, request_id="r" * 128)
    assert chat.ByteSize() <= cap_bytes


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_free_heap_can_be_given_back_to_the_system():
    trim = malloc_trim()
    assert trim is not None
    assert trim() in (0, 1)  # 1: memory was released
