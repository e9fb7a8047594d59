"""The servicer's stream of n samples, in process: each message tagged with its sample's
index and in order within it, total_usage on the last one only, and every slot released
when the call ends, whether it finished, one sample failed, or the client cancelled."""

from __future__ import annotations

import asyncio

import grpc

from pagoda.protos import generation_pb2 as pb
from pagoda.scheduler_svc.api import GenerationServicer
from pagoda.scheduler_svc.core import FinishReason, RequestOutput, Usage
from pagoda.scheduler_svc.core.request import sample_request_ids
from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.output_streams import OutputSlot
from pagoda.scheduler_svc.settings import ServiceConfig
from tests.unit.test_api_admission import Context, CountingTokenizer, FakeLoop


class WritingContext(Context):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[pb.GenerateResponse] = []

    def peer(self) -> str:
        return "peer"

    async def write(self, message) -> None:
        self.written.append(message)
        await asyncio.sleep(0)


class SamplesLoop(FakeLoop):
    """Opens a slot per sample; the test publishes into them."""

    def __init__(self) -> None:
        super().__init__(num_waiting=0)
        self.slots: list[OutputSlot] = []
        self.released: list[str] = []

    def submit_samples(self, valid):
        self.slots = [OutputSlot(i) for i in sample_request_ids(valid.request_id, valid.n)]
        return self.slots

    def release(self, slot):
        self.released.append(slot.request_id)


def usage(num_completion_tokens: int, num_cached_tokens: int) -> Usage:
    return Usage(4, num_completion_tokens, num_cached_tokens, 0)


def run(script, n: int = 3):
    """Generate with n samples while `script(slots)` publishes; the written messages,
    the released slot ids and the call's status (None: OK)."""
    loop = SamplesLoop()
    service = GenerationServicer(loop, Metrics(), CountingTokenizer(), ServiceConfig(), "m")
    context = WritingContext()

    async def scenario():
        request = pb.GenerateRequest(prompt="hi", n=n, request_id="call")
        handler = asyncio.ensure_future(service.Generate(request, context))
        while not loop.slots:
            await asyncio.sleep(0)
        await script(loop.slots, handler)
        try:
            await handler
        except asyncio.CancelledError:
            return "cancelled"
        return context.code

    code = asyncio.run(scenario())
    return context.written, loop.released, code


def test_samples_stream_tagged_with_their_index_and_the_last_message_totals_usage():
    async def script(slots, handler):
        slots[2].publish(RequestOutput(slots[2].request_id, "c", [3], None))
        slots[0].publish(RequestOutput(slots[0].request_id, "a", [1], None))
        await asyncio.sleep(0.01)
        slots[0].publish(
            RequestOutput(
                slots[0].request_id, "b", [2], None, FinishReason.LENGTH, None, usage(2, 0)
            )
        )
        slots[1].publish(
            RequestOutput(slots[1].request_id, "d", [4], None, FinishReason.STOP, None, usage(1, 4))
        )
        await asyncio.sleep(0.01)
        slots[2].publish(
            RequestOutput(slots[2].request_id, "", [], None, FinishReason.LENGTH, None, usage(1, 4))
        )

    written, released, code = run(script)
    assert code is None
    assert {message.request_id for message in written} == {"call"}
    texts = {index: "".join(m.text for m in written if m.index == index) for index in range(3)}
    assert texts == {0: "ab", 1: "d", 2: "c"}
    finals = [m for m in written if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted(m.index for m in finals) == [0, 1, 2] and finals[-1] is written[-1]
    assert [m.HasField("total_usage") for m in written].count(True) == 1
    total = written[-1].total_usage
    assert (total.prompt_tokens, total.completion_tokens, total.cached_prompt_tokens) == (4, 4, 0)
    assert sorted(released) == ["peer/call#0", "peer/call#1", "peer/call#2"]


def test_a_failed_sample_ends_the_call_and_releases_every_slot():
    async def script(slots, handler):
        slots[0].publish(RequestOutput(slots[0].request_id, "a", [1], None))
        slots[1].publish(
            RequestOutput(slots[1].request_id, "", [], None, FinishReason.ERROR, "it broke")
        )

    written, released, code = run(script)
    assert code == grpc.StatusCode.INTERNAL
    assert sorted(released) == ["peer/call#0", "peer/call#1", "peer/call#2"]


def test_a_cancelled_call_releases_every_slot():
    async def script(slots, handler):
        slots[1].publish(RequestOutput(slots[1].request_id, "a", [1], None))
        await asyncio.sleep(0.01)
        handler.cancel()

    written, released, code = run(script)
    assert code == "cancelled" and [m.index for m in written] == [1]
    assert sorted(released) == ["peer/call#0", "peer/call#1", "peer/call#2"]
