"""The edge's own reading of one sample's text, message by message, before it is written:
a thinking model's reasoning split from its answer (reasoning.SampleReasoning), then the
calls of tools read from the answer as they stream (tool_call_stream.ToolCallStream).
Part of the gRPC edge: the response writer applies it to each message it builds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagoda.protos import generation_pb2
from pagoda.scheduler_svc.core import FinishReason, RequestOutput, ValidRequest
from pagoda.scheduler_svc.reasoning import SampleReasoning, sample_reasonings
from pagoda.scheduler_svc.tool_call_stream import ToolCallStream
from pagoda.scheduler_svc.tools import ValidTools


@dataclass(slots=True)
class SampleEdge:
    reasoning: SampleReasoning | None = None
    calls: ToolCallStream | None = None

    def apply(
        self, response: generation_pb2.GenerateResponse, output: RequestOutput
    ) -> list[generation_pb2.GenerateResponse]:
        """`response` (of `output`) read, in place, and the messages to write for it: its
        thinking moved to reasoning_text, on the sample's last message its thinking's
        tokens counted in the usage (the output's too, which the request's total_usage
        adds up); its calls' new pieces in tool_call_deltas, and on the last message the
        calls whole (finish_reason TOOL_CALLS, unless the output ended inside one). Where
        text follows a call that began in it, the text goes on in a message of its own
        after (ToolCallStream._drain), which takes over the ending's fields."""
        last = output.finish_reason is not None
        if self.reasoning is not None:
            response.reasoning_text, response.text = self.reasoning.push(
                response.text, response.token_ids, last=last
            )
            if last and output.usage is not None:
                output.usage.reasoning_tokens = self.reasoning.num_tokens
                response.usage.reasoning_tokens = self.reasoning.num_tokens
        if self.calls is None:
            return [response]
        return self._read_calls(response, last and output.finish_reason is not FinishReason.ERROR)

    def _read_calls(
        self, response: generation_pb2.GenerateResponse, last: bool
    ) -> list[generation_pb2.GenerateResponse]:
        calls = self.calls
        assert calls is not None
        messages = calls.flush(response.text) if last else calls.push(response.text)
        responses = [response]
        for _ in messages[1:]:
            responses.append(
                generation_pb2.GenerateResponse(
                    request_id=response.request_id, index=response.index
                )
            )
        for message, (text, pieces) in zip(responses, messages, strict=True):
            message.text = text
            for piece in pieces:
                message.tool_call_deltas.add(
                    index=piece.index, id=piece.id, name=piece.name, arguments=piece.arguments
                )
        end = responses[-1]
        if end is not response:
            _hand_over_ending(response, end)
        if last and calls.calls:
            for call in calls.calls:
                end.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
            if not calls.open_call:
                end.finish_reason = generation_pb2.TOOL_CALLS
        return responses


def _hand_over_ending(
    first: generation_pb2.GenerateResponse, end: generation_pb2.GenerateResponse
) -> None:
    """The ending's fields (finish_reason, usage, timings) moved from `first` to `end`."""
    end.finish_reason = first.finish_reason
    first.finish_reason = generation_pb2.FINISH_REASON_UNSPECIFIED
    for name in ("usage", "timings"):
        if first.HasField(name):
            getattr(end, name).CopyFrom(getattr(first, name))
            first.ClearField(name)


def sample_edges(
    valid: ValidRequest, n: int, token_bytes: Callable[[int], bytes]
) -> list[SampleEdge | None]:
    """The edge's reading of each of a request's n samples (None each where it has none),
    given each token's bytes, for a thinking model's count."""
    reasonings = sample_reasonings(valid.thinking, n, token_bytes)
    tools = valid.tools
    if not (isinstance(tools, ValidTools) and tools.reads_calls and tools.streams):
        tools = None
    if tools is None and reasonings[0] is None:
        return [None] * n
    return [
        SampleEdge(reasoning, None if tools is None else ToolCallStream(tools))
        for reasoning in reasonings
    ]
