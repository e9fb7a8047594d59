"""How a call of a tool is written: where a tagged call may begin in text
(shown_before_call), a call object whole (call_of, calls_of), and read piece by piece (for
tool_call_stream.py) the head of a call, {"name": a declared tool, "arguments": up to the
arguments' "{", and where a JSON value that began ends."""

from __future__ import annotations

import enum
import json
import secrets
from typing import Any

from pagoda.scheduler_svc.stop_strings import held_back_length
from pagoda.scheduler_svc.tools import CALL_OPEN

BLANKS = " \t\n\r"  # JSON's whitespace

# A parsed call before it has an id: (name, arguments text).
Call = tuple[str, str]


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def shown_before_call(text: str) -> tuple[str, int]:
    """The part of `text` (outside calls, tagged formats) a client may see now, and where
    "<tool_call>" begins in it (-1: nowhere). What may begin the tag at the end waits, and
    so do the blanks before it or at the end: before a call they are no text of the answer
    (a model writes "\n\n<tool_call>")."""
    start = text.find(CALL_OPEN)
    end = start if start >= 0 else len(text) - held_back_length(text, (CALL_OPEN,))
    return text[:end].rstrip(), start


class ScanEnd(enum.Enum):
    CLOSED = enum.auto()  # the value scanned closed
    BROKE = enum.auto()  # a "<" outside a string in a tagged call: its JSON broke off


class JsonScan:
    """Where a JSON value ends: its nesting and string state over the pieces fed; from
    `depth` 0 at its first character, 1 inside an object whose rest is scanned. `tagged`:
    a "<" outside a string ends it (BROKE), where the call's tag may close."""

    __slots__ = ("depth", "in_string", "escaped", "tagged")

    def __init__(self, depth: int, tagged: bool) -> None:
        self.depth = depth
        self.in_string = False
        self.escaped = False
        self.tagged = tagged

    def feed(self, text: str) -> tuple[int, ScanEnd | None]:
        """How much of `text` belongs to the value, and how it ended (None: not yet)."""
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        end: tuple[int, ScanEnd | None] = (len(text), None)
        for index, char in enumerate(text):
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth <= 0:
                    end = (index + 1, ScanEnd.CLOSED)
                    break
            elif char == "<" and self.tagged:
                end = (index, ScanEnd.BROKE)
                break
        self.depth, self.in_string, self.escaped = depth, in_string, escaped
        return end


# The head of a call, step by step: each step's spellings (None: the tool's name, a JSON
# string), blanks allowed before each; the last is the arguments' "{".
_HEAD_STEPS = (("{",), ('"name"',), (":",), None, (",",), ('"arguments"', '"parameters"'))
_HEAD_STEPS += ((":",), ("{",))


def read_head(text: str, names: frozenset[str]) -> tuple[int, str] | bool | None:
    """A call's head at the start of `text`: (where its arguments' "{" is, the tool's name);
    False when the text is not written so; None when too little of it is there to say."""
    position, name = 0, ""
    for step in _HEAD_STEPS:
        while position < len(text) and text[position] in BLANKS:
            position += 1
        rest = text[position:]
        if not rest:
            return None
        if step is None:
            read = _read_name(rest, names)
            if not isinstance(read, tuple):
                return read
            name, length = read
            position += length
            continue
        spelled = next((s for s in step if rest.startswith(s)), None)
        if spelled is None:
            return None if any(s.startswith(rest) for s in step) else False
        position += len(spelled)
    return position - 1, name


def _read_name(rest: str, names: frozenset[str]) -> tuple[str, int] | bool | None:
    """A declared tool's name as a JSON string at the start of `rest`: (name, its length
    with the quotes); False, or None when `rest` ends inside a name that may still be one."""
    if rest[0] != '"':
        return False
    end = rest.find('"', 1)
    if end < 0:
        partial = rest[1:]
        return None if any(name.startswith(partial) for name in names) else False
    name = rest[1:end]
    return (name, end + 1) if name in names else False


def parse_json(text: str) -> Any:
    """The value of a JSON text; None when it is not one."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # a model's "[[[[..." nests past json's limit
        return None


def calls_of(value: Any, names: frozenset[str]) -> list[Call] | None:
    """A call object, or a non-empty list of them, as models write them untagged."""
    items = value if isinstance(value, list) else [value]
    calls = [call_of(item, names) for item in items]
    if not calls or None in calls:
        return None
    return calls  # type: ignore[return-value]


def call_of(value: Any, names: frozenset[str]) -> Call | None:
    """{"name": a declared tool, "arguments" (Llama: "parameters"): an object, or an object's
    JSON text} -> (name, arguments as JSON text)."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):
        arguments = parse_json(arguments)
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)
