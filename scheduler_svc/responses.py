"""Domain outputs -> pagoda.v1.GenerateResponse messages, for the servicer's streams.

Part of the gRPC edge (protobuf types stop here): the servicer and its response writer
send what these build; nothing under them sees a message.
"""

from __future__ import annotations

from collections.abc import Callable

from pagoda.protos import generation_pb2
from pagoda.scheduler_svc.core import FinishReason, RequestOutput, Usage

_FINISH_REASONS = {
    FinishReason.LENGTH: generation_pb2.LENGTH,
    FinishReason.STOP: generation_pb2.STOP,
    FinishReason.CANCELLED: generation_pb2.CANCELLED,
    FinishReason.ERROR: generation_pb2.ERROR,
}


def to_response(
    output: RequestOutput,
    request_id: str | None = None,
    token_bytes: Callable[[int], bytes] | None = None,
    index: int = 0,
) -> generation_pb2.GenerateResponse:
    """`request_id`: the id the client knows the request by (default: the server's);
    `token_bytes`: each token's text, for the logprobs (None: ids only); `index`: the
    sample's (n > 1)."""
    response = generation_pb2.GenerateResponse(
        request_id=output.request_id if request_id is None else request_id,
        text=output.text,
        token_ids=output.token_ids,
        index=index,
    )
    for logprob in output.logprobs or ():
        entry = response.logprobs.add(
            token_id=logprob.token_id,
            logprob=logprob.logprob,
            top_token_ids=logprob.top_token_ids,
            top_logprobs=logprob.top_logprobs,
        )
        if token_bytes is not None:
            entry.token_bytes = token_bytes(logprob.token_id)
            entry.top_token_bytes.extend(map(token_bytes, logprob.top_token_ids))
    if output.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS[output.finish_reason]
    if output.tool_calls:
        response.finish_reason = generation_pb2.TOOL_CALLS
        for call in output.tool_calls:
            response.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
    if output.usage is not None:
        response.usage.CopyFrom(to_usage(output.usage))
    if output.timings is not None:
        response.timings.CopyFrom(
            generation_pb2.Timings(
                queued_ms=output.timings.queued_ms,
                first_token_ms=output.timings.first_token_ms,
                total_ms=output.timings.total_ms,
            )
        )
    return response


def to_usage(usage: Usage) -> generation_pb2.Usage:
    return generation_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        num_preemptions=usage.num_preemptions,
        reasoning_tokens=usage.reasoning_tokens,
    )


def total_usage(usages: list[Usage]) -> Usage:
    """A request's usage from its samples' (sample 0 first): the prompt once, as sample 0
    computed it; completions, preemptions and reasoning tokens summed."""
    first = usages[0]
    return Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(usage.completion_tokens for usage in usages),
        cached_prompt_tokens=first.cached_prompt_tokens,
        num_preemptions=sum(usage.num_preemptions for usage in usages),
        reasoning_tokens=sum(usage.reasoning_tokens for usage in usages),
    )
