"""The client's chunks -> OpenAI's JSON: whole responses, logprobs and usage (the stream's
events are built from the same pieces in `stream_events`).

Pure: no I/O. A token's string is its text from the gRPC logprobs (`bytes` its UTF-8
bytes; a token that holds part of a character shows U+FFFD in the string, its bytes are
exact); from a server that sends ids only, `token_id:<id>` (the form of vLLM's
--return-tokens-as-token-ids) with `bytes` null.

Calls of tools come whole on a sample's last chunk (and in pieces before it, when they
stream); a whole response gives them in its message (the content null when the output held
no other text). A thinking model's reasoning (Chunk.reasoning_text) is the message's
`reasoning_content`, as vLLM and DeepSeek's API name it, and `reasoning`, the name vLLM
moves to (both, as vLLM sends them), left out when there is none.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagoda.client.results import Chunk, TokenLogprob, ToolCall, Usage
from pagoda.openai_front.errors import FrontError
from pagoda.openai_front.schemas import Endpoint
from pagoda.openai_front.translation import Call


@dataclass(frozen=True, slots=True)
class Header:
    """What every object of one response repeats."""

    id: str
    created_s: int
    model: str
    endpoint: Endpoint

    @property
    def object(self) -> str:
        return "chat.completion" if self.endpoint == "chat" else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"

    def fields(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created_s,
            "model": self.model,
        }


@dataclass(slots=True)
class Choice:
    """One sample's chunks joined: choice `index` of the response."""

    call: Call
    sample: int = 0  # its index within the call (Chunk.index)
    texts: list[str] = field(default_factory=list)
    reasoning_texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    # Where each call that streamed in pieces began: the length of the text before it (a
    # chunk's text is taken to come before the calls it begins). Its length is the number
    # of calls streamed so far; calls that came whole only at the finish have none.
    call_offsets: list[int] = field(default_factory=list)

    @property
    def index(self) -> int:
        return self.call.choice_index + self.sample

    def add(self, chunk: Chunk) -> None:
        self.texts.append(chunk.text)
        for delta in chunk.tool_call_deltas:
            if delta.index == len(self.call_offsets):  # the call's first piece
                self.call_offsets.append(sum(map(len, self.texts)))
        self.reasoning_texts.append(chunk.reasoning_text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs or ())
        if chunk.finish_reason is not None:
            self.finish_reason = finish_reason(chunk.finish_reason)
            self.usage = chunk.usage
            self.tool_calls = chunk.tool_calls


def finish_reason(grpc_reason: str) -> str:
    """OpenAI's finish_reason for the gRPC one; a server-side cancel is an error here."""
    if grpc_reason in ("stop", "length", "tool_calls"):
        return grpc_reason
    if grpc_reason == "cancelled":
        raise FrontError(
            503,
            "the server cancelled the request (it is shutting down); retry",
            "server_error",
            None,
            "service_unavailable",
        )
    raise FrontError(500, f"the request ended with {grpc_reason!r}", "server_error")


def token_name(token_id: int, token_bytes: bytes = b"") -> str:
    if token_bytes:
        return token_bytes.decode("utf-8", errors="replace")
    return f"token_id:{token_id}"


def _bytes_json(token_bytes: bytes) -> list[int] | None:
    return list(token_bytes) if token_bytes else None


def _tops(entry: TokenLogprob, num_top: int) -> list[tuple[int, float, bytes]]:
    """(id, logprob, bytes) of the first `num_top` alternatives."""
    tops_bytes = entry.top_token_bytes or [b""] * len(entry.top_token_ids)
    return list(
        zip(
            entry.top_token_ids[:num_top],
            entry.top_logprobs[:num_top],
            tops_bytes[:num_top],
            strict=True,
        )
    )


def logprobs_json(
    endpoint: Endpoint, entries: Iterable[TokenLogprob], num_top: int
) -> dict[str, Any]:
    """OpenAI's logprobs object for these tokens, keeping `num_top` alternatives each."""
    entries = list(entries)
    if endpoint == "chat":
        return {"content": [_chat_token(entry, num_top) for entry in entries]}
    return {
        "tokens": [token_name(e.token_id, e.token_bytes) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_name(t, b): lp for t, lp, b in _tops(e, num_top)} for e in entries],
        "text_offset": None,  # the offsets of the choice's text would need its prompt's too
    }


def _chat_token(entry: TokenLogprob, num_top: int) -> dict[str, Any]:
    return {
        "token": token_name(entry.token_id, entry.token_bytes),
        "logprob": entry.logprob,
        "bytes": _bytes_json(entry.token_bytes),
        "top_logprobs": [
            {"token": token_name(t, b), "logprob": lp, "bytes": _bytes_json(b)}
            for t, lp, b in _tops(entry, num_top)
        ],
    }


def usage_json(choices: Iterable[Choice]) -> dict[str, Any]:
    """Usage over all choices: each prompt counted once (by its lowest choice, the sample
    that computed it), every choice's completion tokens; a thinking model's reasoning
    tokens among them when there are any (no such key otherwise, as before)."""
    prompt_tokens = cached_tokens = completion_tokens = reasoning_tokens = 0
    counted_prompts: set[int] = set()
    for choice in sorted(choices, key=lambda choice: choice.index):
        usage = choice.usage
        if usage is None:
            continue
        completion_tokens += usage.completion_tokens
        reasoning_tokens += usage.reasoning_tokens
        if choice.call.prompt_index not in counted_prompts:
            counted_prompts.add(choice.call.prompt_index)
            prompt_tokens += usage.prompt_tokens
            cached_tokens += usage.cached_prompt_tokens
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def whole_response(
    header: Header, choices: list[Choice], num_top_logprobs: int | None
) -> dict[str, Any]:
    """The non-streamed response of finished choices, in index order."""
    body = header.fields(header.object)
    body["choices"] = [
        _whole_choice(header.endpoint, c, num_top_logprobs)
        for c in sorted(choices, key=lambda c: c.index)
    ]
    body["usage"] = usage_json(choices)
    return body


def _whole_choice(endpoint: Endpoint, choice: Choice, num_top: int | None) -> dict[str, Any]:
    text = "".join(choice.texts)
    logprobs = None if num_top is None else logprobs_json(endpoint, choice.logprobs, num_top)
    out: dict[str, Any] = {"index": choice.index}
    if endpoint == "chat" and choice.tool_calls:
        out["message"] = {
            "role": "assistant",
            "content": text if text.strip() else None,
            "tool_calls": [tool_call_json(call) for call in choice.tool_calls],
        }
    elif endpoint == "chat":
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["text"] = text
    reasoning = "".join(choice.reasoning_texts)
    if endpoint == "chat" and reasoning:
        out["message"].update(reasoning_fields(reasoning))
    out["logprobs"] = logprobs
    out["finish_reason"] = choice.finish_reason
    if choice.call.return_token_ids:
        out["token_ids"] = choice.token_ids
    return out


def reasoning_fields(reasoning: str) -> dict[str, str]:
    """A chat message's or delta's thinking under both names clients read."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
