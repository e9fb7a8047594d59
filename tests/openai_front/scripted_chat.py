"""A fake gRPC server whose Chat answers with given messages, for the front's tests of calls
streamed in pieces (text around them, several calls, n > 1, a cut) without a model, and
the builders of those messages."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from pagoda.protos import generation_pb2 as pb
from tests.client.fake_server import FakeGenerationServicer, FakeServer

CALL_A = pb.ToolCall(id="call_" + "a" * 24, name="get_weather", arguments='{"city": "Paris"}')
CALL_B = pb.ToolCall(id="call_" + "b" * 24, name="get_time", arguments="{}")


class ScriptedServicer(FakeGenerationServicer):
    """Every Chat gets `script`, whatever it asked (recorded as the fake's requests are)."""

    def __init__(self, script: Iterable[pb.GenerateResponse]) -> None:
        super().__init__()
        self.script = list(script)

    def Chat(self, request, context):
        self._admit("Chat", request, context)
        yield from self.script


@contextmanager
def scripted_server(script: Iterable[pb.GenerateResponse]) -> Iterator[FakeServer]:
    with FakeServer(ScriptedServicer(script)) as server:
        yield server


def first_piece(call: pb.ToolCall, index: int = 0, arguments: str = "") -> pb.ToolCallDelta:
    return pb.ToolCallDelta(index=index, id=call.id, name=call.name, arguments=arguments)


def more(arguments: str, index: int = 0) -> pb.ToolCallDelta:
    return pb.ToolCallDelta(index=index, arguments=arguments)


def token(text: str = "", *pieces: pb.ToolCallDelta, sample: int = 0) -> pb.GenerateResponse:
    """One token's message: its text outside calls and its pieces of calls."""
    return pb.GenerateResponse(
        request_id="r", index=sample, text=text, token_ids=[7], tool_call_deltas=pieces
    )


def last(*calls: pb.ToolCall, reason: int = pb.TOOL_CALLS, sample: int = 0) -> pb.GenerateResponse:
    """A sample's last message: its calls whole, its finish and usage."""
    return pb.GenerateResponse(
        request_id="r",
        index=sample,
        finish_reason=reason,
        tool_calls=calls,
        usage=pb.Usage(prompt_tokens=5, completion_tokens=4),
    )


def in_pieces(call: pb.ToolCall, index: int = 0, size: int = 6) -> list[pb.ToolCallDelta]:
    """A call as the server streams it: its id and name, then its arguments `size`
    characters a piece."""
    text = call.arguments
    return [first_piece(call, index)] + [
        more(text[at : at + size], index) for at in range(0, len(text), size)
    ]
