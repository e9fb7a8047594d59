"""A thinking model's reasoning, kept apart from its answer as the output streams.

Models such as Qwen3 and DeepSeek-R1 think before they answer, between <think> and
</think>. When the chat template writes those tags (TextTokenizer.thinks), a Chat
request's output is split: the text between the tags streams as
GenerateResponse.reasoning_text, the text after them as `text`. The tags, the blanks
inside them at either end and the blanks between </think> and the answer are left out;
token_ids still stream every token. A constraint's grammar lets the thinking come first
(grammars.ThinkingFirst) and holds the answer.

Where the thinking begins is the prompt's to say (thinking_of): a template that opens
<think> in the assistant's turn (DeepSeek-R1, Qwen3's thinking-only models) starts the
output inside it; any other may or may not begin with <think> (Qwen3). An output that
begins otherwise is all answer; one that ends before </think> (max_new_tokens) is all
reasoning. Nothing after the first </think> is read for tags again.

Two readers split the same text: the edge (response_writer) for what the client sees,
and a request's ToolCallReader, so that no call is read inside the thinking.
"""

from __future__ import annotations

import codecs
import enum
from collections.abc import Callable

from pagoda.scheduler_svc.stop_strings import held_back_length

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_CLOSE = (THINK_CLOSE,)


class Thinking(enum.Enum):
    """Where a request's output stands towards the thinking when it begins."""

    MAY_BEGIN = "may begin"  # the output may begin with <think>
    BEGUN = "begun"  # the prompt opened <think>: the output begins inside it


def thinking_of(rendered_prompt: str) -> Thinking:
    """The thinking of a chat whose prompt, rendered by a thinking model's template, is
    `rendered_prompt` (the assistant's turn opened)."""
    return Thinking.BEGUN if rendered_prompt.rstrip().endswith(THINK_OPEN) else Thinking.MAY_BEGIN


def sample_reasonings(
    thinking: object, n: int, token_bytes: Callable[[int], bytes]
) -> list[SampleReasoning | None]:
    """The edge's reasoning of each of a request's n samples, given its
    ValidRequest.thinking (None each when its output is not split) and each token's bytes
    as decoding gives them."""
    if not isinstance(thinking, Thinking):
        return [None] * n
    return [SampleReasoning(thinking, token_bytes) for _ in range(n)]


class _Part(enum.Enum):
    LEADING = "leading"  # blanks so far, or part of "<think>": not yet known
    INSIDE = "inside"  # in the thinking
    CLOSED = "closed"  # after </think>, before the answer's first other character
    ANSWER = "answer"


class ReasoningSplit:
    """One sample's output text -> (reasoning, answer), piece by piece.

    With `verbatim`, the first part is everything before the answer as written, tags and
    blanks included (a ToolCallReader passes it on unread, for the edge to split)."""

    __slots__ = ("verbatim", "_part", "_held", "_blanks")

    def __init__(self, thinking: Thinking, *, verbatim: bool = False) -> None:
        self.verbatim = verbatim
        self._part = _Part.INSIDE if thinking is Thinking.BEGUN else _Part.LEADING
        self._held = ""  # text not yet placed: a possible tag's start, or blanks
        self._blanks = True  # inside: no reasoning text yet (its leading blanks are dropped)

    @property
    def answering(self) -> bool:
        """Whether the answer has begun: every later piece is answer."""
        return self._part is _Part.ANSWER

    @property
    def undecided(self) -> bool:
        """Whether it is not yet known if the output thinks (blanks, or part of <think>)."""
        return self._part is _Part.LEADING

    def push(self, text: str) -> tuple[str, str]:
        """The next piece of output -> (reasoning, answer) the client may see now."""
        if self._part is _Part.ANSWER:
            return "", text
        text, self._held = self._held + text, ""
        if self._part is _Part.LEADING:
            start = text.lstrip()
            if not start or (THINK_OPEN.startswith(start) and start != THINK_OPEN):
                self._held = text  # blanks, or "<thi": held until settled
                return "", ""
            if not start.startswith(THINK_OPEN):
                self._part = _Part.ANSWER
                return "", text
            self._part = _Part.INSIDE
            opened = len(text) - len(start) + len(THINK_OPEN)
            reasoning, answer = self._inside(text[opened:])
            return (text[:opened] + reasoning if self.verbatim else reasoning), answer
        if self._part is _Part.INSIDE:
            return self._inside(text)
        return self._closed(text)

    def flush(self, tail: str = "") -> tuple[str, str]:
        """The output ended, `tail` its last piece: the (reasoning, answer) still to send."""
        reasoning, answer = self.push(tail)
        more, rest = self._flush_held()
        return reasoning + more, answer + rest

    def _flush_held(self) -> tuple[str, str]:
        """The held text placed for good: the output ended."""
        held, self._held = self._held, ""
        if self._part is _Part.LEADING:  # blanks, or a "<thi" that never became a tag
            self._part = _Part.ANSWER
            return "", held
        if self.verbatim:
            return held, ""
        return self._started(held).rstrip(), ""  # a "</thi" that never closed stays

    def _inside(self, text: str) -> tuple[str, str]:
        """Text of the thinking, which may close in it."""
        end = text.find(THINK_CLOSE)
        if end >= 0:
            self._part = _Part.CLOSED
            closed = end + len(THINK_CLOSE)
            reasoning = text[:closed] if self.verbatim else self._started(text[:end]).rstrip()
            after, answer = self._closed(text[closed:])
            return reasoning + after, answer
        keep = len(text) - held_back_length(text, _CLOSE)
        reasoning, self._held = text[:keep], text[keep:]
        if not self.verbatim:  # blanks at its end wait: the thinking may close after them
            reasoning = self._started(reasoning)
            kept = reasoning.rstrip()
            self._held = reasoning[len(kept) :] + self._held
            reasoning = kept
        return reasoning, ""

    def _started(self, reasoning: str) -> str:
        """Reasoning text without the blanks that open the thinking."""
        if self._blanks:
            reasoning = reasoning.lstrip()
            self._blanks = not reasoning
        return reasoning

    def _closed(self, text: str) -> tuple[str, str]:
        """Text after </think>: blanks until the answer begins."""
        answer = text.lstrip()
        if not answer:
            return (text if self.verbatim else ""), ""
        self._part = _Part.ANSWER
        return (text[: len(text) - len(answer)] if self.verbatim else ""), answer


class SampleReasoning:
    """The edge's part for one sample: the split of what the client sees, and the count of
    the thinking's tokens (Usage.reasoning_tokens): those before the first token that holds
    (part of) the answer's first character, the tags and the blanks after </think>
    included. The count replays each token's own bytes, decoded in turn, through a split of
    its own, so text that a stop string or a tool call held back does not shift it, and a
    character split across tokens (a blank such as U+3000 among them) counts where it
    falls."""

    __slots__ = (
        "split",
        "num_tokens",
        "_tokens",
        "_token_bytes",
        "_decoder",
        "_num_undecided",
        "_num_partial",
    )

    def __init__(self, thinking: Thinking, token_bytes: Callable[[int], bytes]) -> None:
        self.split = ReasoningSplit(thinking)
        self.num_tokens = 0
        self._tokens = ReasoningSplit(thinking, verbatim=True)
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._num_undecided = 0  # tokens of blanks or of "<thi" so far, under MAY_BEGIN
        self._num_partial = 0  # tokens of a character not whole yet

    def push(self, text: str, token_ids, *, last: bool) -> tuple[str, str]:
        """One message's text and tokens -> its (reasoning, answer); `last`: the sample's
        last message."""
        self._count(token_ids)
        return self.split.flush(text) if last else self.split.push(text)

    def _count(self, token_ids) -> None:
        tokens = self._tokens
        for token_id in token_ids:
            if tokens.answering:
                return
            text = self._decoder.decode(self._token_bytes(token_id))
            # A token that ends inside a character goes where that character does: it is
            # placed by the token that ends the character.
            ends_inside = bool(self._decoder.getstate()[0])
            if text or not ends_inside:
                passed, _ = tokens.push(text)
                num_placed = self._num_partial + (0 if ends_inside else 1)
                if tokens.undecided:
                    self._num_undecided += num_placed
                elif not tokens.answering:  # in the thinking, or closing it
                    self.num_tokens += self._num_undecided + num_placed
                    self._num_undecided = 0
                elif passed:  # the answer began in this token, after its text's first character
                    self.num_tokens += self._num_undecided + self._num_partial
                self._num_partial = 0
            if ends_inside:
                self._num_partial += 1
