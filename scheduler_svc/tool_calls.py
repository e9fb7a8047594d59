"""Calls of tools read from a sample's output as it streams (see scheduler_svc.tools).

The output processor gives each sample of a request whose tools are read (tool_choice not
NONE) a ToolCallReader, which runs the request's stop-string matcher first when it has
one. Text that cannot be part of a call streams as it comes; from where a call may begin,
the text is held until the sample ends:
- HERMES and GENERIC formats: from "<tool_call>" on (text at the end that may begin that
  tag, and blanks at the end, are held until the next tokens settle them);
- JSON format: an answer that begins with "{" or "[" is held whole;
- REQUIRED or a named function: the whole output (constrained to the calls' JSON).
A thinking model's reasoning (reasoning.py) is passed on unread: calls are read in the
answer after it.
When the sample ends, the held text is parsed. Calls of declared tools whose arguments are
JSON objects become the last output's tool_calls, and the text between and after them its
text. Held text that does not parse that way is returned as text, whole: nothing the model
wrote is lost. With parallel_tool_calls false, AUTO keeps the first call and, in the
tagged formats, ends the sample as soon as that call's tag closes.
Calls that stream (ChatRequest.stream_tool_calls) are read at the edge
(tool_call_stream.py); a reader is then made only to end such a sample at that close, and
passes all text on.
"""

from __future__ import annotations

import json

from pagoda.scheduler_svc.call_syntax import (
    Call,
    call_of,
    calls_of,
    new_call_id,
    parse_json,
    shown_before_call,
)
from pagoda.scheduler_svc.core import ToolCall
from pagoda.scheduler_svc.reasoning import ReasoningSplit, Thinking
from pagoda.scheduler_svc.stop_strings import StopStringMatcher
from pagoda.scheduler_svc.tool_call_stream import ToolCallStream
from pagoda.scheduler_svc.tools import CALL_CLOSE, CALL_OPEN, ToolChoice, ToolFormat, ValidTools


class ToolCallReader:
    """One sample's tool-call state: the text held since a call may have begun, and once it
    ended, the calls read in it. Called from the step loop only (the output processor)."""

    __slots__ = (
        "tools",
        "stop",
        "thinking",
        "calls",
        "_pending",
        "_held",
        "_plain",
        "_ends_at_close",
        "_closed",
        "_window",
        "_opened",
    )
    # The output processor calls push() for every token of a reader.
    trigger = ""

    def __init__(
        self,
        tools: ValidTools,
        stop: StopStringMatcher | None = None,
        thinking: Thinking | None = None,
    ) -> None:
        self.tools = tools
        self.stop = stop
        # Where the answer begins, when the model thinks first: the text before it passes.
        self.thinking = None if thinking is None else ReasoningSplit(thinking, verbatim=True)
        self.calls: tuple[ToolCall, ...] = ()
        # Text that may begin a call: a partial "<tool_call>", or a JSON answer's leading
        # blanks (until its first other character says whether it is a call).
        self._pending = ""
        # Held since a call may have begun (None: nothing held). Constrained output is
        # nothing but calls: held from the start.
        self._held: str | None = "" if tools.constrained else None
        self._plain = False  # JSON format: the answer began as text, so it is text
        self._ends_at_close = tools.ends_at_first_close
        self._closed = False  # the first call's tag closed, where that ends the sample
        # Streamed calls (the edge reads them, tool_call_stream.py): the text passes on,
        # and its last characters are kept to find the first call's tags (None: held).
        self._window: str | None = "" if tools.streams else None
        self._opened = False

    @property
    def held_text(self) -> str:
        held = self._pending + (self._held or "")
        return self.stop.held_text + held if self.stop is not None else held

    @property
    def num_tokens_inactive(self) -> int:
        return self.stop.num_tokens_inactive if self.stop is not None else 0

    def push(self, text: str) -> tuple[str, bool]:
        """One token's text -> (text the client may see now, whether the sample ends here:
        a stop string matched, or its only call closed)."""
        stopped = False
        if self.stop is not None:
            text, stopped = self.stop.push(text)
        if self.thinking is not None and not self.thinking.answering:
            reasoning, answer = self.thinking.push(text)
            return reasoning + self._read(answer), stopped or self._closed
        return self._read(text), stopped or self._closed

    def flush(self, tail: str = "") -> str:
        """The sample ended, `tail` its last text: read the held text for calls (into
        `calls`) and return the text still to send."""
        if self.stop is not None:
            tail = self.stop.flush(tail)
        reasoning = ""
        if self.thinking is not None:
            reasoning, tail = self.thinking.flush(tail)
        text = reasoning + self._read(tail) + self._pending
        held, self._held, self._pending = self._held, None, ""
        if not held:
            return text
        parsed = self._parse(held)
        if parsed is None:
            return text + held
        content, calls = parsed
        if not self.tools.parallel:
            calls = calls[:1]
        calls = as_written(self.tools, held, calls)
        self.calls = tuple(ToolCall(new_call_id(), name, arguments) for name, arguments in calls)
        return text + content

    def _read(self, text: str) -> str:
        if self._window is not None:
            return self._watch(text)
        if self._held is not None:
            self._held += text
            if self._ends_at_close:  # only the tail can hold a tag this text closed
                tail = self._held[-(len(text) + len(CALL_CLOSE)) :]
                self._closed = self._closed or CALL_CLOSE in tail
            return ""
        if self._plain:
            return text
        buffer = self._pending + text if self._pending else text
        if self.tools.format is ToolFormat.JSON:
            start = buffer.lstrip()[:1]
            if not start:  # blanks so far
                self._pending = buffer
                return ""
            self._pending = ""
            if start in "{[":
                self._held = buffer
                return ""
            self._plain = True
            return buffer
        shown, start = shown_before_call(buffer)  # so an answer of calls alone shows none
        if start >= 0:
            self._pending = ""
            self._held = buffer[len(shown) : start]
            return shown + self._read(buffer[start:])
        self._pending = buffer[len(shown) :]
        return shown

    def _watch(self, text: str) -> str:
        """Streamed calls: `text` passes on; where the first call's tag closes, the sample
        ends (ends_at_first_close)."""
        window = self._window + text  # type: ignore[operator]
        if not self._opened:
            start = window.find(CALL_OPEN)
            self._opened = start >= 0
            window = window[start + len(CALL_OPEN) :] if self._opened else window
        if self._opened and self._ends_at_close:
            self._closed = self._closed or CALL_CLOSE in window
        self._window = window[-len(CALL_CLOSE) :]
        return text

    def _parse(self, held: str) -> tuple[str, list[Call]] | None:
        tools = self.tools
        if tools.choice is ToolChoice.FUNCTION:
            arguments = parse_json(held)
            if not isinstance(arguments, dict):
                return None
            return "", [(tools.function_name, json.dumps(arguments, ensure_ascii=False))]
        if tools.choice is ToolChoice.REQUIRED or tools.format is ToolFormat.JSON:
            calls = calls_of(parse_json(held), tools.names)
            return None if calls is None else ("", calls)
        return read_tagged_calls(held, tools.names)


def as_written(tools: ValidTools, held: str, calls: list[Call]) -> list[Call]:
    """`calls`, read whole in `held`, with their arguments as the model wrote them where a
    streamed reading of the same text finds them (tool_call_stream.py), so that a call
    reads the same whole and streamed. Elsewhere (arguments written as a JSON string, or
    before the name) they stay as call_of re-serialized them."""
    stream = ToolCallStream(tools)
    stream.flush(held)
    written = stream.calls
    kept = []
    for index, (name, arguments) in enumerate(calls):
        if index < len(written) and written[index].name == name:
            raw = written[index].arguments
            if parse_json(raw) == parse_json(arguments):
                arguments = raw
        kept.append((name, arguments))
    return kept


def read_tagged_calls(text: str, names: frozenset[str]) -> tuple[str, list[Call]] | None:
    """The calls between <tool_call> tags in `text` (the last one may be left open: EOS came
    first) and the text outside them ("" when only blanks); None unless every pair of tags
    holds a call of a declared tool."""
    calls: list[Call] = []
    outside: list[str] = []
    position = 0
    while (start := text.find(CALL_OPEN, position)) >= 0:
        outside.append(text[position:start])
        end = text.find(CALL_CLOSE, start)
        body = text[start + len(CALL_OPEN) : len(text) if end < 0 else end]
        call = call_of(parse_json(body), names)
        if call is None:
            return None
        calls.append(call)
        position = len(text) if end < 0 else end + len(CALL_CLOSE)
    outside.append(text[position:])
    content = "".join(outside)
    return (content if content.strip() else ""), calls
