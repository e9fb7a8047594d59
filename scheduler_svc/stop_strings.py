"""Stop strings on a request's text: matched across token boundaries, with the text that
may begin one held back until the next tokens settle it (see output_processor)."""

from __future__ import annotations


def find_stop_string(text: str, stop_strings: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string in `text` begins, or None."""
    earliest: int | None = None
    for stop in stop_strings:
        index = text.find(stop)
        if index >= 0 and (earliest is None or index < earliest):
            earliest = index
    return earliest


def held_back_length(text: str, stop_strings: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string.

    Each stop string is compared where its first character occurs in the tail of `text`,
    longest suffix first; no table of prefixes is built (one of 16 stop strings of 256
    bytes held 0.87 MB, for every queued request: security review N5).
    """
    longest = 0
    for stop in stop_strings:
        index = text.find(stop[0], max(len(text) - len(stop) + 1, 0))
        while index >= 0 and len(text) - index > longest:
            if stop.startswith(text[index:]):
                longest = len(text) - index
                break
            index = text.find(stop[0], index + 1)
    return longest


class StopStringMatcher:
    """The stop-string state of one request: the text held back so far, and how many more
    tokens come before a stop string may end it (min_new_tokens)."""

    __slots__ = (
        "stop_strings",
        "_first_chars",
        "trigger",
        "held_text",
        "num_tokens_inactive",
    )

    def __init__(self, stop_strings: tuple[str, ...], min_new_tokens: int = 0) -> None:
        if not stop_strings or not all(stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.stop_strings = stop_strings
        # A match or a held suffix starts with one of these: text without any is free.
        self._first_chars = tuple({s[0] for s in stop_strings})
        # While nothing is held and the matcher is active, text that does not contain
        # `trigger` passes push() unchanged, so the output processor skips the call. The
        # stop strings' common first character; "" (in every text) when they start
        # differently.
        self.trigger = self._first_chars[0] if len(self._first_chars) == 1 else ""
        self.held_text = ""
        self.num_tokens_inactive = min_new_tokens

    def push(self, text: str) -> tuple[str, bool]:
        """One token's detokenized text -> (text the client may see now, whether a stop
        string matched).

        Within the first min_new_tokens tokens nothing matches and nothing is held. After
        a match the caller finishes the request; later text is dropped.
        """
        held = self.held_text
        buffer = held + text if held else text
        if self.num_tokens_inactive:
            self.num_tokens_inactive -= 1
        else:
            for char in self._first_chars:
                if char in buffer:
                    return self._match(buffer)
        if held:
            self.held_text = ""
        return buffer, False

    def _match(self, buffer: str) -> tuple[str, bool]:
        cut = find_stop_string(buffer, self.stop_strings)
        if cut is not None:
            self.held_text = ""
            return buffer[:cut], True
        hold = held_back_length(buffer, self.stop_strings)
        self.held_text = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def flush(self, tail: str = "") -> str:
        """The request ended without a stop string, `tail` its last text (not matched): held
        text is ordinary text after all."""
        held, self.held_text = self.held_text, ""
        return held + tail
