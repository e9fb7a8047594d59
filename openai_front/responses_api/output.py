"""A finished Chat call -> the Responses API's response object and its output items.

Pure but for the items' random ids. The output is a reasoning item of the model's
thinking when it thought (a model that thinks: Chunk.reasoning_text), then the answer's
messages and function_call items (`answer_items`): a message of the text when the model
wrote text (whitespace alone beside calls is none, as chat's content is null then) or
called no tool, one function_call item per call; calls that streamed in pieces
(stream_tool_calls) cut the text into a message before each call and one after them, as
the stream sent them. A finish by length is status "incomplete" (reason
max_output_tokens), and so is the item the output ended in: a message, thinking that
nothing followed, or a streamed call that nothing followed (cut short: its arguments are
not JSON). A call that came whole is never cut short: without stream_tool_calls a cut call
is text.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.client.results import ToolCall, Usage
from pagoda.openai_front.errors import FrontError
from pagoda.openai_front.responses import Choice
from pagoda.openai_front.responses_api.schema import ResponsesRequest
from pagoda.openai_front.translation import OPENAI_DEFAULT_TEMPERATURE

# What OpenAI reports for top_p and parallel_tool_calls left out, and what the scheduler
# then does: no nucleus cut, several calls a turn.
DEFAULT_TOP_P = 1.0
DEFAULT_PARALLEL_TOOL_CALLS = True


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What every snapshot of one response repeats: its id, model and request settings."""

    id: str
    created_at_s: int
    model: str
    settings: dict[str, Any]  # `echoed_settings` of its request

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: Usage | None,
    ) -> dict[str, Any]:
        """The response object; status "in_progress", "completed" or "incomplete"."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at_s,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": None if usage is None else usage_json(usage),
            **self.settings,
        }


def echoed_settings(body: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as the response object repeats them, defaults filled in."""
    text = body.text.format if body.text and body.text.format else {"type": "text"}
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "metadata": body.metadata or {},
        "parallel_tool_calls": (
            DEFAULT_PARALLEL_TOOL_CALLS
            if body.parallel_tool_calls is None
            else body.parallel_tool_calls
        ),
        "temperature": OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        "top_p": DEFAULT_TOP_P if body.top_p is None else body.top_p,
        "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
        "tools": [tool.model_dump() for tool in body.tools or ()],
        "text": {"format": text},
        "truncation": "disabled",
        "background": False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,  # nothing is stored, whatever the request said
    }


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_prompt_tokens,
            # OpenAI's count of tokens written with an explicit cache retention
            # (prompt_cache_retention); the prefix cache here is implicit.
            "cache_write_tokens": 0,
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def status_of(finish_reason: str) -> str:
    """The response's status for OpenAI's finish_reason of its one sample."""
    return "incomplete" if finish_reason == "length" else "completed"


def shows_message(text: str, tool_calls: Sequence[ToolCall]) -> bool:
    return bool(text.strip()) or not tool_calls


def new_item_id(prefix: str) -> str:
    """An output item's id: "rs", "msg" or "fc", "_" and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, status: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The model's thinking, in the open: `parts` its one reasoning_text part, none while
    it begins. No summary is written and nothing is encrypted."""
    return {"type": "reasoning", "id": item_id, "summary": [], "content": parts, "status": status}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def reasoning_status(response_status: str, answered: bool) -> str:
    """A reasoning item's status: completed once an answer or a call followed it, else the
    response's (a finish by length cut the thinking short)."""
    return "completed" if answered else response_status


def message_item(item_id: str, status: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant's message; `parts` its one text part, none while it begins."""
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": parts,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def function_call_item(
    item_id: str, call: ToolCall, arguments: str | None = None, status: str = "completed"
) -> dict[str, Any]:
    """A call of a function tool; `arguments` instead of the call's while it streams."""
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
        "status": status,
    }


def whole_response(head: ResponseHead, choice: Choice) -> dict[str, Any]:
    """The non-streamed response of the call's one finished sample."""
    if choice.finish_reason is None:
        raise FrontError(
            500, "the scheduler ended the call without its last message", "server_error"
        )
    status = status_of(choice.finish_reason)
    text = "".join(choice.texts)
    reasoning = "".join(choice.reasoning_texts)
    output = []
    if reasoning:
        thought = reasoning_status(status, bool(text or choice.tool_calls))
        output.append(reasoning_item(new_item_id("rs"), thought, [reasoning_part(reasoning)]))
    output += answer_items(text, choice.tool_calls, choice.call_offsets, status)
    return head.response(status, output, choice.usage)


def answer_items(
    text: str, calls: Sequence[ToolCall], call_offsets: Sequence[int], status: str
) -> list[dict[str, Any]]:
    """The answer's messages and calls in the order the model wrote them. The first
    len(call_offsets) calls streamed, call k beginning call_offsets[k] characters into the
    text: the text before each is a message when it is not blank, completed since the call
    followed it; the call is completed when text or another streamed call followed it, else
    it ended the output and has the response's `status`. The text after the streamed calls
    is the last message (shown blank only when there are no calls), with `status`; the
    calls that came whole follow it, completed."""
    items = []
    start = 0
    streamed = calls[: len(call_offsets)]
    for k, call in enumerate(streamed):
        before, start = text[start : call_offsets[k]], call_offsets[k]
        if before.strip():
            items.append(_message(before, "completed"))
        followed = k + 1 < len(streamed) or len(text) > start
        call_status = "completed" if followed else status
        items.append(function_call_item(new_item_id("fc"), call, status=call_status))
    if shows_message(text[start:], calls):
        items.append(_message(text[start:], status))
    items += [function_call_item(new_item_id("fc"), call) for call in calls[len(streamed) :]]
    return items


def _message(text: str, status: str) -> dict[str, Any]:
    return message_item(new_item_id("msg"), status, [text_part(text)])
