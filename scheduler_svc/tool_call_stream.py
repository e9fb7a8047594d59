"""Calls of tools streamed as the model writes them (ChatRequest.stream_tool_calls).

The edge gives each sample of such a request a ToolCallStream (sample_edge.py), which
reads the sample's answer message by message into the text outside calls, which goes on
as it comes, and the pieces of its calls (CallPiece). Where calls are:
- tagged formats (HERMES, GENERIC) under AUTO: between "<tool_call>" and "</tool_call>";
  the blanks next to a call are no text of the answer;
- JSON format under AUTO: an answer that begins with "{" is a call, with "[" a list;
- REQUIRED: a list of calls; a named function: its arguments object alone.
A call streams from its head on: {"name": a declared tool, "arguments" (Llama writes
"parameters"): up to the arguments' "{", the order in which a constrained call's grammar
writes it. Its id and name go out then, and the arguments' text as it comes until that
object closes. A call written otherwise is held until it ends and parsed whole
(call_syntax.call_of): one piece then, its arguments as JSON text, or text when it is no
call. A JSON answer whose first call is not written so is held whole, as without
streaming. A call is a call from its first piece on: its arguments are the text its pieces
gave, not JSON where the output ended inside them (`open_call`, as when one opened but
its head was cut off) or a tool that is not strict broke them.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from pagoda.scheduler_svc.call_syntax import (
    BLANKS,
    JsonScan,
    ScanEnd,
    call_of,
    calls_of,
    new_call_id,
    parse_json,
    read_head,
    shown_before_call,
)
from pagoda.scheduler_svc.core import ToolCall
from pagoda.scheduler_svc.stop_strings import held_back_length
from pagoda.scheduler_svc.tools import CALL_CLOSE, CALL_OPEN, ToolChoice, ToolFormat, ValidTools


class CallPiece(NamedTuple):
    """More of call `index` of a sample: its first piece has the id and the name."""

    index: int
    id: str
    name: str
    arguments: str


# One message's part: its text, and its calls' pieces (see ToolCallStream._drain).
Message = tuple[str, list[CallPiece]]


class _Mode(enum.Enum):
    TEXT = enum.auto()  # outside calls, tagged formats
    LEAD = enum.auto()  # the answer's first blanks: JSON calls, REQUIRED, a named function
    LIST = enum.auto()  # in a list of calls: the next call, "," or "]"
    HEAD = enum.auto()  # a call's head, until its arguments begin
    ARGUMENTS = enum.auto()  # a call's arguments, streaming
    OBJECT_END = enum.auto()  # the rest of a call's object after its arguments
    BODY = enum.auto()  # a call written in another order, held until it ends
    CLOSE = enum.auto()  # what is left of a tagged call, up to "</tool_call>"
    WHOLE = enum.auto()  # a JSON answer held whole, read when it ends
    PLAIN = enum.auto()  # text to the end
    DONE = enum.auto()  # the calls ended the answer: the rest is left out


class ToolCallStream:
    """One sample's calls, read as its answer streams; from the edge only."""

    def __init__(self, tools: ValidTools) -> None:
        self.tools = tools
        self._tagged = tools.choice is ToolChoice.AUTO and tools.format is not ToolFormat.JSON
        self._mode = _Mode.TEXT if self._tagged else _Mode.LEAD
        self._buffer = ""  # text read but not yet placed
        self._body = ""  # a held call's text (BODY)
        self._in_list = False
        self._after_call = False  # blanks after a call are no text
        self._before = ""  # the blanks before a tagged call: text again if it is none
        self._scan = JsonScan(0, self._tagged)
        # The calls so far: id, name, and their arguments' pieces.
        self._calls: list[tuple[str, str, list[str]]] = []
        # What was read since the last drain, in order: text and calls' pieces.
        self._written: list[str | CallPiece] = []
        self.open_call = False  # the answer ended inside a call's head or arguments
        self._readers = {
            _Mode.TEXT: self._text,
            _Mode.LEAD: self._lead,
            _Mode.LIST: self._list,
            _Mode.HEAD: self._head,
            _Mode.ARGUMENTS: self._arguments,
            _Mode.OBJECT_END: self._object_end,
            _Mode.BODY: self._held_body,
            _Mode.CLOSE: self._close,
        }

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(ToolCall(id, name, "".join(parts)) for id, name, parts in self._calls)

    def push(self, text: str) -> list[Message]:
        """More of the answer -> what to send now: (text, the calls' new pieces) a message."""
        self._buffer += text
        while self._buffer and self._step():
            pass
        return self._drain()

    def flush(self, tail: str = "") -> list[Message]:
        """The answer ended, `tail` its last text: place what is still held."""
        self._buffer += tail
        while self._buffer and self._step():
            pass
        mode, held, self._buffer = self._mode, self._buffer, ""
        if mode is _Mode.TEXT:
            self._show(held.lstrip() if self._after_call else held)
        elif mode in (_Mode.LEAD, _Mode.PLAIN):
            self._show(held)
        elif mode is _Mode.HEAD:  # a call's first text, never a head
            self._show(f"{self._before}{CALL_OPEN}{held}" if self._tagged else held)
        elif mode is _Mode.BODY:
            self._settle_body(self._body + held, closed=False)
        elif mode is _Mode.WHOLE:
            self._settle_whole(held)
        self.open_call = mode in (_Mode.HEAD, _Mode.ARGUMENTS)
        self._mode = _Mode.DONE
        return self._drain()

    def _step(self) -> bool:
        """Read from the buffer in the current mode; False: more text is needed."""
        mode = self._mode
        if mode is _Mode.PLAIN:
            text = self._buffer.lstrip() if self._after_call else self._buffer
            self._after_call = not text
            self._show(text)
        elif mode is not _Mode.WHOLE and mode is not _Mode.DONE:
            return self._readers[mode]()
        if mode is not _Mode.WHOLE:  # which holds the answer to its end
            self._buffer = ""
        return False

    def _text(self) -> bool:
        buffer = self._buffer
        if self._after_call:
            buffer = buffer.lstrip()
            self._after_call = not buffer
        shown, start = shown_before_call(buffer)
        self._show(shown)
        if start >= 0:
            self._before = buffer[len(shown) : start]
            self._buffer = buffer[start + len(CALL_OPEN) :]
            self._mode = _Mode.HEAD
            return True
        self._buffer = buffer[len(shown) :]
        return False

    def _lead(self) -> bool:
        """The answer's first character says what it is."""
        rest = self._buffer.lstrip(BLANKS)
        if not rest:
            return False
        if self.tools.choice is ToolChoice.FUNCTION:  # the arguments, from the first "{"
            self._start_call(self.tools.function_name)
            self._buffer = rest
            self._mode = _Mode.ARGUMENTS
            return True
        first = rest[1:].lstrip(BLANKS) if rest[0] == "[" else rest
        head = read_head(first, self.tools.names) if first else None
        if head is None:
            return False
        if head is False:  # not a call written in order: held whole, as without streaming
            self._mode = _Mode.PLAIN if rest[0] not in "{[" else _Mode.WHOLE
            return self._mode is _Mode.PLAIN
        self._in_list = rest[0] == "["
        self._buffer = first
        self._mode = _Mode.HEAD
        return True

    def _list(self) -> bool:
        """Between the calls of a list: "," and the next call, or "]"."""
        rest = self._buffer.lstrip(BLANKS)
        if not rest:
            self._buffer = ""
            return False
        if rest[0] == ",":
            rest = rest[1:].lstrip(BLANKS)
            if not rest:
                self._buffer = ","
                return False
        elif rest[0] == "]":
            self._buffer, self._after_call = rest[1:], True
            self._mode = _Mode.PLAIN
            return True
        self._buffer = rest
        self._mode = _Mode.HEAD if self.tools.parallel else _Mode.DONE
        return True

    def _head(self) -> bool:
        head = read_head(self._buffer, self.tools.names)
        if head is None:
            return False
        if head is False:
            self._mode, self._body = _Mode.BODY, ""
            self._scan = JsonScan(0, tagged=False)
            return True
        start, name = head
        self._start_call(name)
        self._buffer = self._buffer[start:]
        self._scan = JsonScan(0, self._tagged)
        self._mode = _Mode.ARGUMENTS
        return True

    def _arguments(self) -> bool:
        length, end = self._scan.feed(self._buffer)
        if length:
            self._calls[-1][2].append(self._buffer[:length])
            self._written.append(CallPiece(len(self._calls) - 1, "", "", self._buffer[:length]))
        self._buffer = self._buffer[length:]
        if end is None:
            return False
        if end is ScanEnd.BROKE:
            self._mode = _Mode.CLOSE
        elif self.tools.choice is ToolChoice.FUNCTION:
            self._mode = _Mode.DONE
        else:
            self._scan = JsonScan(1, self._tagged)  # inside the call's object
            self._mode = _Mode.OBJECT_END
        return True

    def _object_end(self) -> bool:
        length, end = self._scan.feed(self._buffer)
        self._buffer = self._buffer[length:]
        if end is None:
            return False
        self._end_call()
        return True

    def _held_body(self) -> bool:
        """A call in another order: held to its "</tool_call>", or its object's end."""
        if self._tagged:
            self._body += self._buffer
            end = self._body.find(CALL_CLOSE)
            if end < 0:
                self._buffer = ""
                return False
            self._buffer = self._body[end + len(CALL_CLOSE) :]
            self._settle_body(self._body[:end])
            self._mode = _Mode.TEXT
            return True
        length, end_kind = self._scan.feed(self._buffer)
        self._body += self._buffer[:length]
        self._buffer = self._buffer[length:]
        if end_kind is None:
            return False
        self._settle_body(self._body)
        self._mode = _Mode.LIST if self._in_list else _Mode.PLAIN
        return True

    def _close(self) -> bool:
        end = self._buffer.find(CALL_CLOSE)
        if end < 0:
            keep = held_back_length(self._buffer, (CALL_CLOSE,))
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._buffer = self._buffer[end + len(CALL_CLOSE) :]
        self._mode, self._after_call = _Mode.TEXT, True
        return True

    def _end_call(self) -> None:
        if self._tagged:
            self._mode = _Mode.CLOSE
        elif self._in_list:
            self._mode = _Mode.LIST
        else:
            self._mode, self._after_call = _Mode.PLAIN, True

    def _settle_body(self, body: str, closed: bool = True) -> None:
        """A held call's whole text (`closed`: its tag closed): one piece when it is a
        call, else text."""
        call = call_of(parse_json(body), self.tools.names)
        if call is None:
            if self._tagged:
                body = f"{self._before}{CALL_OPEN}{body}{CALL_CLOSE if closed else ''}"
            self._show(body)
            return
        self._start_call(call[0], call[1])
        self._after_call = True

    def _settle_whole(self, held: str) -> None:
        calls = calls_of(parse_json(held), self.tools.names)
        if calls is None:
            self._show(held)
            return
        for name, arguments in calls if self.tools.parallel else calls[:1]:
            self._start_call(name, arguments)

    def _start_call(self, name: str, arguments: str = "") -> None:
        call_id = new_call_id()
        self._written.append(CallPiece(len(self._calls), call_id, name, arguments))
        self._calls.append((call_id, name, [arguments]))

    def _show(self, text: str) -> None:
        if text:
            self._written.append(text)

    def _drain(self) -> list[Message]:
        """What was read since the last drain as messages, each laid out as a client reads
        one: the pieces of calls begun before it, then text, then the calls it begins.
        Usually one; more where a call began and text followed it (nothing at all: one
        empty message)."""
        messages: list[Message] = []
        texts: list[str] = []
        pieces: list[CallPiece] = []
        begun: set[int] = set()  # the calls begun in this message
        for item in self._written:
            if isinstance(item, str):
                if begun:  # text after a call begun here: the next message's
                    messages.append(("".join(texts), pieces))
                    texts, pieces, begun = [], [], set()
                texts.append(item)
                continue
            if item.id:
                begun.add(item.index)
            elif item.index not in begun and texts:  # an earlier call's, after text
                messages.append(("".join(texts), pieces))
                texts, pieces, begun = [], [], set()
            if pieces and pieces[-1].index == item.index and not item.id:
                pieces[-1] = pieces[-1]._replace(arguments=pieces[-1].arguments + item.arguments)
            else:
                pieces.append(item)
        self._written = []
        return [*messages, ("".join(texts), pieces)]
