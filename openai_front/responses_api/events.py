"""A streamed response's server-sent events, from the chunks of its one Chat call.

Pure but for the items' random ids; one `ResponseEvents` per response, fed its chunks in
order. Each event is `event: <type>` and `data: {"type", "sequence_number", ...}`, numbered
from 0: response.created and response.in_progress; then the items in the order the model
wrote them, each ended before the next begins (the order of OpenAI's own streams): a
thinking model's reasoning item (output_item.added, content_part.added, a
reasoning_text.delta per chunk of reasoning, reasoning_text.done, content_part.done,
output_item.done); a message (output_item.added, content_part.added, an output_text.delta
per chunk of text, output_text.done, content_part.done, output_item.done); a call
(output_item.added with empty arguments, a function_call_arguments.delta per piece,
function_call_arguments.done, output_item.done). Calls that stream (stream_tool_calls) come
as they are written: a call ends the message before it, text after a call ends the call
and begins a new message; calls that come whole on the last chunk follow everything, one
delta each. Then response.completed or response.incomplete holding the whole response. The
item the output ended in has the response's status (a call cut short is incomplete), the
others are completed. Whitespace before any text of a message is held until text follows
or what comes next decides (beside calls it is no message), so the streamed output is the
whole response's (`output.answer_items`), item for item.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda.client.results import Chunk, ToolCall, ToolCallDelta, Usage
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


@dataclass(slots=True)
class _OpenCall:
    """The function_call item streaming now: its first piece's id and name, the arguments'
    pieces so far."""

    item_id: str
    output_index: int
    call_id: str
    name: str
    pieces: list[str] = field(default_factory=list)

    def call(self) -> ToolCall:
        return ToolCall(self.call_id, self.name, "".join(self.pieces))


class ResponseEvents:
    def __init__(self, head: ResponseHead) -> None:
        self._head = head
        self._sequence_number = 0
        self._reasoning_id = new_item_id("rs")
        self._reasoning: list[str] = []  # the deltas sent while the reasoning item is open
        self._message_id = new_item_id("msg")
        self._message_index: int | None = None  # its output_index while it is open
        self._held = ""  # text not sent yet: whitespace before a message began
        self._sent: list[str] = []  # the open message's deltas
        self._call: _OpenCall | None = None
        self._num_calls = 0  # calls begun, streamed or whole
        self._output: list[dict[str, Any]] = []  # finished items

    def opening(self) -> list[str]:
        snapshot = self._head.response("in_progress", [], None)
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def chunk(self, chunk: Chunk) -> list[str]:
        """The events of one chunk, in the order its parts were written: its reasoning, more
        of the call streaming now, its text, the calls it begins, and on the last chunk the
        finish. None for a chunk of nothing to show (tokens of held text)."""
        events = self._send_reasoning(chunk.reasoning_text) if chunk.reasoning_text else []
        begun = self._num_calls
        for delta in chunk.tool_call_deltas:
            if delta.index < begun:
                events += self._send_arguments(delta.arguments)
        if chunk.text:
            events += self._send_text(chunk.text)
        for delta in chunk.tool_call_deltas:
            if delta.index >= begun:
                events += self._send_call_piece(delta)
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
        """End the reasoning item, if one is open."""
        if not self._reasoning:
            return []
        part = reasoning_part("".join(self._reasoning))
        item = reasoning_item(self._reasoning_id, status, [part])
        self._reasoning = []
        self._output.append(item)
        return [
            self._on_reasoning("response.reasoning_text.done", text=part["text"]),
            self._on_reasoning("response.content_part.done", part=part),
            self._event("response.output_item.done", output_index=REASONING_INDEX, item=item),
        ]

    def _send_text(self, text: str) -> list[str]:
        """Text ends the reasoning and the call before it; it is sent once a message is
        open or it is more than whitespace."""
        events = self._end_reasoning("completed") + self._end_call("completed")
        self._held += text
        if self._message_index is not None or self._held.strip():
            events += self._send_held()
        return events

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

    def _end_message(self, status: str) -> list[str]:
        """End the message, if one is open."""
        if self._message_index is None:
            return []
        part = text_part("".join(self._sent))
        item = message_item(self._message_id, status, [part])
        events = [
            self._on_message("response.output_text.done", text=part["text"]),
            self._on_message("response.content_part.done", part=part),
            self._event("response.output_item.done", output_index=self._message_index, item=item),
        ]
        self._output.append(item)
        self._message_id, self._message_index, self._sent = new_item_id("msg"), None, []
        return events

    def _send_call_piece(self, delta: ToolCallDelta) -> list[str]:
        """A piece of a call that began in this chunk: its first piece begins it."""
        events = self._begin_call(delta.id, delta.name) if delta.index == self._num_calls else []
        return events + self._send_arguments(delta.arguments)

    def _begin_call(self, call_id: str, name: str) -> list[str]:
        """A call ends whatever came before it; blanks held before it are no message."""
        ended = self._end_reasoning("completed") + self._end_message("completed")
        events = ended + self._end_call("completed")
        self._held = ""
        self._num_calls += 1
        self._call = _OpenCall(new_item_id("fc"), len(self._output), call_id, name)
        item = function_call_item(self._call.item_id, self._call.call(), status="in_progress")
        added = self._event(
            "response.output_item.added", output_index=self._call.output_index, item=item
        )
        return [*events, added]

    def _send_arguments(self, text: str) -> list[str]:
        if not text or self._call is None:
            return []
        self._call.pieces.append(text)
        return [self._on_call(self._call, "response.function_call_arguments.delta", delta=text)]

    def _end_call(self, status: str) -> list[str]:
        """End the call streaming now, if one is."""
        open_call, self._call = self._call, None
        if open_call is None:
            return []
        call = open_call.call()
        item = function_call_item(open_call.item_id, call, status=status)
        self._output.append(item)
        return [
            self._on_call(
                open_call, "response.function_call_arguments.done", arguments=call.arguments
            ),
            self._event(
                "response.output_item.done", output_index=open_call.output_index, item=item
            ),
        ]

    def _finish(self, status: str, calls: Sequence[ToolCall], usage: Usage | None) -> list[str]:
        """End the open item with the response's status; the calls that did not stream
        follow, whole and completed (never cut short: a cut call that did not stream is
        text)."""
        events = self._end_reasoning(reasoning_status(status, bool(calls)))
        if self._message_index is None and shows_message(self._held, calls):
            events += self._send_held()
        events += self._end_message(status) + self._end_call(status)
        for call in calls[self._num_calls :]:
            events += self._begin_call(call.id, call.name)
            events += self._send_arguments(call.arguments) + self._end_call("completed")
        response = self._head.response(status, self._output, usage)
        events.append(self._event(f"response.{status}", response=response))
        return events

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

    def _on_call(self, call: _OpenCall, kind: str, **fields: Any) -> str:
        """An event of a call's arguments."""
        return self._event(kind, item_id=call.item_id, output_index=call.output_index, **fields)

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
