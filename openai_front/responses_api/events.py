"""A streamed response's server-sent events, from the chunks of its one Chat call.

Pure but for the items' random ids; one `ResponseEvents` per response, fed its chunks in
order. Each event is `event: <type>` and `data: {"type", "sequence_number", ...}`, numbered
from 0: response.created and response.in_progress; a thinking model's reasoning item
(output_item.added, content_part.added, a reasoning_text.delta per chunk of reasoning,
reasoning_text.done, content_part.done, output_item.done: the order of OpenAI's own
streams, done when the answer's first text or the finish comes); the message
(output_item.added, content_part.added, an output_text.delta per chunk of text,
output_text.done, content_part.done, output_item.done); each call (output_item.added with
empty arguments, one function_call_arguments.delta of the whole arguments, as calls come
whole on the last chunk, function_call_arguments.done, output_item.done); then
response.completed or response.incomplete holding the whole response. Whitespace before
any text is held until text follows or the finish decides (beside calls it is no message),
so the streamed output is the whole response's, item for item.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagoda.client.results import Chunk, ToolCall, Usage
from pagoda.openai_front.errors import FrontError
from pagoda.openai_front.responses import finish_reason
from pagoda.openai_front.responses_api.output import (
    ResponseHead,
    function_call_item,
    message_item,
    new_item_id,
    reasoning_item,
    reasoning_part,
    reasoning_status,
    shows_message,
    status_of,
    text_part,
)
from pagoda.openai_front.streaming import sse

TEXT_PART = 0  # content_index of the message's one part
REASONING_PART = 0  # and of the reasoning item's
REASONING_INDEX = 0  # output_index of the reasoning item: all thinking comes first


class ResponseEvents:
    def __init__(self, head: ResponseHead) -> None:
        self._head = head
        self._sequence_number = 0
        self._reasoning_id = new_item_id("rs")
        self._reasoning: list[str] = []  # the deltas sent while the reasoning item is open
        self._message_id = new_item_id("msg")
        self._message_index: int | None = None  # its output_index once it began
        self._held = ""  # text not sent yet: whitespace before the message began
        self._sent: list[str] = []
        self._output: list[dict[str, Any]] = []  # finished items

    def opening(self) -> list[str]:
        snapshot = self._head.response("in_progress", [], None)
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def chunk(self, chunk: Chunk) -> list[str]:
        """The events of one chunk: none for a chunk of no text (tokens of a call, held by
        the scheduler), a delta of its reasoning, a delta of its text (which ends the
        reasoning), and on the last chunk the finish."""
        events = []
        if chunk.reasoning_text:
            events += self._send_reasoning(chunk.reasoning_text)
        if chunk.text and self._reasoning:
            events += self._end_reasoning("completed")
        self._held += chunk.text
        if self._message_index is not None or self._held.strip():
            events += self._send_held()
        if chunk.finish_reason is not None:
            reason = finish_reason(chunk.finish_reason)  # a server-side cancel raises here
            events += self._finish(status_of(reason), chunk.tool_calls, chunk.usage)
        return events

    def error(self, error: FrontError) -> str:
        """A failure after the stream began (its status line long sent)."""
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def _send_reasoning(self, text: str) -> list[str]:
        events = []
        if not self._reasoning:  # the item begins
            item = reasoning_item(self._reasoning_id, "in_progress", [])
            events += [
                self._event("response.output_item.added", output_index=REASONING_INDEX, item=item),
                self._on_reasoning("response.content_part.added", part=reasoning_part("")),
            ]
        events.append(self._on_reasoning("response.reasoning_text.delta", delta=text))
        self._reasoning.append(text)
        return events

    def _end_reasoning(self, status: str) -> list[str]:
        part = reasoning_part("".join(self._reasoning))
        item = reasoning_item(self._reasoning_id, status, [part])
        self._reasoning = []
        self._output.append(item)
        return [
            self._on_reasoning("response.reasoning_text.done", text=part["text"]),
            self._on_reasoning("response.content_part.done", part=part),
            self._event("response.output_item.done", output_index=REASONING_INDEX, item=item),
        ]

    def _send_held(self) -> list[str]:
        events = [] if self._message_index is not None else self._begin_message()
        if self._held:  # no empty deltas
            events.append(self._on_message("response.output_text.delta", delta=self._held))
            self._sent.append(self._held)
            self._held = ""
        return events

    def _begin_message(self) -> list[str]:
        self._message_index = len(self._output)
        item = message_item(self._message_id, "in_progress", [])
        return [
            self._event("response.output_item.added", output_index=self._message_index, item=item),
            self._on_message("response.content_part.added", part=text_part("")),
        ]

    def _finish(self, status: str, calls: Sequence[ToolCall], usage: Usage | None) -> list[str]:
        events = []
        if self._reasoning:
            events += self._end_reasoning(reasoning_status(status, bool(calls)))
        if self._message_index is None and shows_message(self._held, calls):
            events += self._send_held()
        if self._message_index is not None:
            part = text_part("".join(self._sent))
            item = message_item(self._message_id, status, [part])
            events += [
                self._on_message("response.output_text.done", text=part["text"]),
                self._on_message("response.content_part.done", part=part),
                self._event(
                    "response.output_item.done", output_index=self._message_index, item=item
                ),
            ]
            self._output.append(item)
        for call in calls:
            events += self._call_events(len(self._output), call)
        response = self._head.response(status, self._output, usage)
        events.append(self._event(f"response.{status}", response=response))
        return events

    def _call_events(self, index: int, call: ToolCall) -> list[str]:
        item_id = new_item_id("fc")
        item = function_call_item(item_id, call)
        self._output.append(item)
        begun = function_call_item(item_id, call, arguments="", status="in_progress")
        on_call = {"item_id": item_id, "output_index": index}
        return [
            self._event("response.output_item.added", output_index=index, item=begun),
            self._event("response.function_call_arguments.delta", **on_call, delta=call.arguments),
            self._event(
                "response.function_call_arguments.done", **on_call, arguments=call.arguments
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _on_message(self, kind: str, **fields: Any) -> str:
        """An event of the message's text part."""
        if kind.startswith("response.output_text."):
            fields["logprobs"] = []  # never asked for here (top_logprobs is refused)
        return self._event(
            kind,
            item_id=self._message_id,
            output_index=self._message_index,
            content_index=TEXT_PART,
            **fields,
        )

    def _on_reasoning(self, kind: str, **fields: Any) -> str:
        """An event of the reasoning item's text part."""
        return self._event(
            kind,
            item_id=self._reasoning_id,
            output_index=REASONING_INDEX,
            content_index=REASONING_PART,
            **fields,
        )

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return sse(data, event=kind)
