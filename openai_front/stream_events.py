"""The client's chunks -> the server-sent events of a chat or completions stream.

Pure: no I/O. A chat stream opens each choice with a role event, then sends one event per
chunk that shows something (its text, or its tokens' ids or logprobs when asked for), each
chunk's logprobs on the event of its text. Calls of tools come as OpenAI and vLLM stream
them, in `tool_calls` deltas by `index` whose `arguments` a client joins: a chunk with
pieces of calls (stream_tool_calls) sends its text first, then one event of its pieces,
one entry per call (the call's first with its `id`, `type` and `function.name`, later ones
with more `function.arguments` only). The last chunk's whole calls are sent only when they
did not stream (a server that sends them whole), all in one event. Beside calls, the
finish ("tool_calls", or "length" for a call cut short) is an event of its own. A
thinking model's reasoning goes in the delta of the chunk that carried it, as
`reasoning_content` (vLLM's and DeepSeek's name) and `reasoning` (the name vLLM moves
to), beside the chunk's `content` when it has
both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from pagoda.client.results import Chunk, ToolCallDelta
from pagoda.openai_front.responses import (
    Choice,
    Header,
    finish_reason,
    logprobs_json,
    reasoning_fields,
    tool_call_json,
    usage_json,
)
from pagoda.openai_front.translation import Call


def role_event(header: Header, index: int, include_usage: bool) -> dict[str, Any]:
    """The first chat event of a choice: the assistant's role, no text yet."""
    choice = {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return _event(header, choice, include_usage)


def chunk_events(
    header: Header,
    call: Call,
    chunk: Chunk,
    num_top_logprobs: int | None,
    include_usage: bool,
    num_streamed_calls: int = 0,
) -> list[dict[str, Any]]:
    """The stream events of one chunk: one, none for a chunk with nothing to show, or for a
    chunk with calls, its text and tokens (when it has any), the calls, then the finish
    (on the last chunk). `num_streamed_calls`: how many of the sample's calls came in
    pieces, this chunk's included; the last chunk's whole calls repeat none of them."""
    # Tokens whose text is held (a call, a stop string's start) have nothing to show,
    # unless their ids or logprobs were asked for.
    shows = bool(
        chunk.text
        or chunk.reasoning_text
        or call.return_token_ids
        or (num_top_logprobs is not None and chunk.logprobs)
    )
    calls = _pieces_json(chunk.tool_call_deltas) + [
        {"index": k, **tool_call_json(tool_call)}
        for k, tool_call in enumerate(chunk.tool_calls)
        if k >= num_streamed_calls
    ]
    if not calls:
        if not shows and chunk.finish_reason is None:
            return []
        return [chunk_event(header, call, chunk, num_top_logprobs, include_usage)]
    events = []
    if shows:
        body = dataclasses.replace(chunk, finish_reason=None)
        events.append(chunk_event(header, call, body, num_top_logprobs, include_usage))
    calls_choice = {
        "index": call.choice_index + chunk.index,
        "delta": {"tool_calls": calls},
        "logprobs": None,
        "finish_reason": None,
    }
    if call.return_token_ids:
        calls_choice["token_ids"] = []
    events.append(_event(header, calls_choice, include_usage))
    if chunk.finish_reason is not None:
        end = dataclasses.replace(chunk, text="", reasoning_text="", token_ids=[], logprobs=None)
        events.append(chunk_event(header, call, end, num_top_logprobs, include_usage))
    return events


def _pieces_json(deltas: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """A chunk's pieces of calls as `tool_calls` delta entries, the pieces of one call
    joined: its first piece with the id, type and name, a later one with more arguments
    (none for a later piece of no text)."""
    entries: list[dict[str, Any]] = []
    for delta in deltas:
        if entries and entries[-1]["index"] == delta.index:
            entries[-1]["function"]["arguments"] += delta.arguments
        elif delta.id:
            function = {"name": delta.name, "arguments": delta.arguments}
            entries.append(
                {"index": delta.index, "id": delta.id, "type": "function", "function": function}
            )
        elif delta.arguments:
            entries.append({"index": delta.index, "function": {"arguments": delta.arguments}})
    return entries


def chunk_event(
    header: Header,
    call: Call,
    chunk: Chunk,
    num_top_logprobs: int | None,
    include_usage: bool,
) -> dict[str, Any]:
    """The stream event of one chunk (its finish_reason set on the last)."""
    reason = None if chunk.finish_reason is None else finish_reason(chunk.finish_reason)
    logprobs = None
    if num_top_logprobs is not None and chunk.logprobs:
        logprobs = logprobs_json(header.endpoint, chunk.logprobs, num_top_logprobs)
    choice: dict[str, Any] = {"index": call.choice_index + chunk.index}
    if header.endpoint == "chat":
        choice["delta"] = _delta(chunk, reason)
    else:
        choice["text"] = chunk.text
    choice["logprobs"] = logprobs
    choice["finish_reason"] = reason
    if call.return_token_ids:
        # The tokens this event's text came from: a benchmark counts them per event.
        choice["token_ids"] = chunk.token_ids
    return _event(header, choice, include_usage)


def _delta(chunk: Chunk, reason: str | None) -> dict[str, str]:
    """A chat event's delta: the chunk's reasoning and its text; an empty content when it
    has neither (tokens of held text whose ids or logprobs were asked for), nothing beside
    the finish."""
    delta = reasoning_fields(chunk.reasoning_text) if chunk.reasoning_text else {}
    if chunk.text or (reason is None and not delta):
        delta["content"] = chunk.text
    return delta


def usage_event(header: Header, choices: Iterable[Choice]) -> dict[str, Any]:
    """The last event under stream_options.include_usage: no choices, the usage."""
    body = header.fields(header.chunk_object)
    body["choices"] = []
    body["usage"] = usage_json(choices)
    return body


def _event(header: Header, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    body = header.fields(header.chunk_object)
    body["choices"] = [choice]
    if include_usage:
        body["usage"] = None
    return body
