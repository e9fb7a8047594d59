"""When a request stops, and which of its text a client may see yet.

Pure functions, plus StopStringMatcher whose only state is the text it holds back.

- EOS (unless ignore_eos) and stop_token_ids end it with STOP; the token id is returned
  but its text is not streamed.
- Stop strings are matched on the detokenized text, across token boundaries; the stop
  string and anything after it are dropped. Text that could be the start of a stop
  string is held back until the next tokens settle it.
- None of these count until min_new_tokens tokens precede the token (as in Hugging
  Face's min_new_tokens: the output then holds at least that many other tokens).
- max_new_tokens and a full context end it with LENGTH.
"""

from __future__ import annotations

from pagoda.scheduler_svc.core.request import FinishReason, ValidStopping


def stops_allowed(num_generated_tokens: int, stopping: ValidStopping) -> bool:
    """Whether the `num_generated_tokens`-th generated token may end the request with STOP."""
    return num_generated_tokens > stopping.min_new_tokens


def token_verdict(
    token_id: int,
    num_generated_tokens: int,
    num_tokens: int,
    stopping: ValidStopping,
    eos_token_ids: frozenset[int],
    max_context_tokens: int,
) -> FinishReason | None:
    """How the `num_generated_tokens`-th generated token ends its request, by its id and
    the lengths alone (stop strings are the matcher's): STOP for a stop token id or EOS
    once stops are allowed, LENGTH at max_new_tokens or a full context, else None."""
    if num_generated_tokens > stopping.min_new_tokens and (  # stops_allowed, inlined
        token_id in stopping.stop_token_ids
        or (token_id in eos_token_ids and not stopping.ignore_eos)
    ):
        return FinishReason.STOP
    if num_generated_tokens >= stopping.max_new_tokens or num_tokens >= max_context_tokens:
        return FinishReason.LENGTH
    return None


def find_stop_string(text: str, stop_strings: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string in `text` begins, or None."""
    earliest: int | None = None
    for stop in stop_strings:
        index = text.find(stop)
        if index >= 0 and (earliest is None or index < earliest):
            earliest = index
    return earliest


def held_back_length(text: str, stop_prefixes: frozenset[str], max_prefix_length: int) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    for length in range(min(len(text), max_prefix_length), 0, -1):
        if text[-length:] in stop_prefixes:
            return length
    return 0


class StopStringMatcher:
    """The stop-string state of one request: the text held back so far."""

    __slots__ = (
        "stop_strings",
        "_prefixes",
        "_max_prefix_length",
        "_first_chars",
        "trigger",
        "held_text",
    )

    def __init__(self, stop_strings: tuple[str, ...]) -> None:
        if not stop_strings or not all(stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.stop_strings = stop_strings
        self._prefixes = frozenset(s[:n] for s in stop_strings for n in range(1, len(s)))
        self._max_prefix_length = max(len(s) for s in stop_strings) - 1
        # A match or a held suffix starts with one of these: text without any is free.
        self._first_chars = tuple({s[0] for s in stop_strings})
        # For callers that skip push() inline: while nothing is held, text that does not
        # contain `trigger` passes unchanged. The stop strings' common first character;
        # "" (in every text) when they start differently.
        self.trigger = self._first_chars[0] if len(self._first_chars) == 1 else ""
        self.held_text = ""

    def push(self, text: str, active: bool) -> tuple[str, bool]:
        """New detokenized text -> (text the client may see now, whether a stop string matched).

        While not `active` (before min_new_tokens) nothing matches and nothing is held.
        After a match the caller finishes the request; later text is dropped.
        """
        held = self.held_text
        buffer = held + text if held else text
        if active:
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
        hold = held_back_length(buffer, self._prefixes, self._max_prefix_length)
        self.held_text = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """The request ended without a stop string: held text is ordinary text after all."""
        held, self.held_text = self.held_text, ""
        return held
