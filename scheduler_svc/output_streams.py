"""Per-request output slots between the step loop and the gRPC streams.

The step loop publishes without ever awaiting: a slot appends every delta that its
reader has not taken yet to one pending output's pieces, so a slow client costs memory
proportional to its own unread tokens and never slows the loop. That is bounded: a slot
holding more than MAX_UNREAD_TOKENS unread drops them and ends its request with
RESOURCE_EXHAUSTED, a client that stopped reading (security review H1).

Readers are woken through a Turnstile, a few per event-loop turn: the step loop shares its
thread with every stream writer, and waking all of a step's readers at once makes one long
turn that the worker's next result waits behind. Woken a few at a time, in order, the loop
sees the worker between them, and a reader whose turn comes late takes several tokens as
one message: under load messages grow, instead of the worker waiting for the writers.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagoda.scheduler_svc.core import FinishReason, RequestOutput, StepOutputs, TokenLogprob

# Unread tokens a slot holds before its request is ended, each top-logprob alternative
# counting as one more token: about 150 KB of text, ids and logprobs. A reader that keeps
# up holds one step's tokens; only one that stopped reading gets here.
MAX_UNREAD_TOKENS = 2048
UNREAD_ERROR_CODE = "RESOURCE_EXHAUSTED"
# Readers a Turnstile wakes per event-loop turn. One: each turn is then one reader's take
# and write (tens of microseconds), so the worker's result and new RPCs wait behind little.
# A sweep with benchmarks.overlap (dummy 10 ms steps, 256 streams, one sitting, on a first
# version whose readers held their place while writing) kept the worker 89, 88, 88, 81, 79
# and 77% busy at widths 1, 2, 4, 16, 64 and unbounded.
READERS_PER_TURN = 1


def unread_message(max_unread_tokens: int) -> str:
    return (
        f"the client left more than {max_unread_tokens} tokens unread; the request was "
        "ended and its unread output dropped"
    )


@dataclass(slots=True)
class OutputSlot:
    """The unread output of one request, kept as the pieces of one coalesced output."""

    request_id: str
    max_unread_tokens: int = MAX_UNREAD_TOKENS
    # Called once when the slot overflows before its request finished, to end the
    # request (the step loop's cancel); not called for a finished one.
    on_overflow: Callable[[str], None] | None = None
    overflowed: bool = False
    # Unread tokens published while the reader was away (writing to its client); those
    # published while it waits in next() are on their way, not left unread.
    _num_unread: int = 0
    _texts: list[str] = field(default_factory=list)
    _token_ids: list[int] = field(default_factory=list)
    _logprobs: list[TokenLogprob] | None = None
    _final: RequestOutput | None = None  # the finishing output, once published
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    # Wakes the reader when output is pending (None: at once). _in_line from the output's
    # coming until the reader takes it or leaves. A reader away from next() (_waiting),
    # writing, when its turn comes takes no place: one stuck writing to a client that
    # stopped reading must not hold the line; it takes at once when it is back.
    turnstile: Turnstile | None = None
    _waiting: bool = False
    _in_line: bool = False
    finished: bool = False
    # The gRPC code to end with when the final output carries an error
    # (None: INTERNAL, a failure of this request alone).
    error_code: str | None = None

    @property
    def has_pending(self) -> bool:
        return bool(self._token_ids) or bool(self._texts) or self._final is not None

    def publish_token(self, text: str, token_id: int) -> None:
        """One token and its text; called by the step loop, never blocks."""
        if self.finished or self.overflowed:
            return
        self._num_unread += not self._waiting
        if self._num_unread > self.max_unread_tokens:
            self._overflow(None)
            return
        self._texts.append(text)
        self._token_ids.append(token_id)
        self._notify()

    def publish(self, output: RequestOutput) -> None:
        """Called by the step loop; never blocks."""
        if self.finished:
            return
        if self.overflowed:
            if output.finish_reason is not None:  # the end of the cancelled request
                self._overflow(output)
            return
        if not self._waiting:
            self._num_unread += len(output.token_ids)
            for logprob in output.logprobs or ():
                self._num_unread += len(logprob.top_token_ids)
        if self._num_unread > self.max_unread_tokens:
            self._overflow(output if output.finish_reason is not None else None)
            return
        self._texts.append(output.text)
        self._token_ids.extend(output.token_ids)
        if output.logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(output.logprobs)
        if output.finish_reason is not None:
            self._final = output
            self.finished = True
        self._notify()

    def _overflow(self, final: RequestOutput | None) -> None:
        """Drop everything unread; end with an error once the request's end is here
        (`final`), asking for that end first if it is not."""
        self._texts, self._token_ids, self._logprobs = [], [], None
        self.error_code = UNREAD_ERROR_CODE
        if final is None:
            if not self.overflowed:
                self.overflowed = True
                if self.on_overflow is not None:
                    self.on_overflow(self.request_id)
            return
        self.overflowed = True
        self._final = RequestOutput(
            request_id=self.request_id,
            text="",
            token_ids=[],
            logprobs=None,
            finish_reason=FinishReason.ERROR,
            error_message=unread_message(self.max_unread_tokens),
            usage=final.usage,
            timings=final.timings,
        )
        self.finished = True
        self._notify()

    def _notify(self) -> None:
        """Output is pending: wake the reader, or have the turnstile wake it."""
        if self.turnstile is None:
            self._ready.set()
        elif not self._in_line and not self._ready.is_set():
            self._in_line = True
            self.turnstile.enter(self)

    def leave(self) -> None:
        """The reader is gone: give up the slot's place in the turnstile's line."""
        if self._in_line:
            self._in_line = False
            if self._ready.is_set():  # woken, never taken: its pass ends here
                assert self.turnstile is not None
                self.turnstile.passed()

    async def next(self) -> RequestOutput:
        """Wait for, and take, everything published since the last call, as one output."""
        self._waiting = True
        try:
            await self._ready.wait()
        finally:
            self._waiting = False
        self._ready.clear()
        if self._in_line:
            self._in_line = False
            assert self.turnstile is not None
            self.turnstile.passed()
        assert self.has_pending
        final = self._final
        output = RequestOutput(
            request_id=self.request_id,
            text="".join(self._texts),
            token_ids=self._token_ids,
            logprobs=self._logprobs,
        )
        if final is not None:
            output.finish_reason = final.finish_reason
            output.error_message = final.error_message
            output.usage = final.usage
            output.timings = final.timings
        self._texts, self._token_ids, self._logprobs, self._final = [], [], None, None
        self._num_unread = 0
        return output


class Turnstile:
    """Wakes the readers of slots with pending output, at most `width` between two
    event-loop turns, in the order their output came: a reader woken in one turn takes in
    the next, and only its taking lets the next one in line through."""

    def __init__(self, width: int = READERS_PER_TURN) -> None:
        if width < 1:
            raise ValueError("a turnstile lets at least one reader through")
        self._width = width
        self._num_passing = 0  # woken, not yet taken
        self._line: deque[OutputSlot] = deque()

    def enter(self, slot: OutputSlot) -> None:
        if self._num_passing < self._width:
            self._wake(slot)
        else:
            self._line.append(slot)

    def passed(self) -> None:
        """A woken reader took its output, or left: the next one in line goes through."""
        self._num_passing -= 1
        line = self._line
        while line and self._num_passing < self._width:
            slot = line.popleft()
            if slot._in_line:  # else it left while waiting in line
                self._wake(slot)

    def _wake(self, slot: OutputSlot) -> None:
        if slot._waiting:  # it takes in the next turn, and passes then
            self._num_passing += 1
        else:  # busy writing: it takes when it is back, without a place
            slot._in_line = False
        slot._ready.set()

    def __len__(self) -> int:
        """Readers waiting in line (woken ones not counted)."""
        return sum(slot._in_line for slot in self._line)


class OutputStreams:
    """The slots of all live requests, by request id."""

    def __init__(
        self,
        *,
        max_unread_tokens: int = MAX_UNREAD_TOKENS,
        on_overflow: Callable[[str], None] | None = None,
        readers_per_turn: int = READERS_PER_TURN,
    ) -> None:
        """`on_overflow(request_id)`: a running request's reader stopped reading; end it."""
        self._slots: dict[str, OutputSlot] = {}
        self._max_unread_tokens = max_unread_tokens
        self._on_overflow = on_overflow
        self._turnstile = Turnstile(readers_per_turn)
        self._empty = asyncio.Event()  # set while no slot is open (a drain waits on it)
        self._empty.set()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def open(self, request_id: str) -> OutputSlot:
        slot = OutputSlot(
            request_id,
            max_unread_tokens=self._max_unread_tokens,
            on_overflow=self._on_overflow,
            turnstile=self._turnstile,
        )
        self._slots[request_id] = slot
        self._empty.clear()
        return slot

    def request_ids(self) -> list[str]:
        return list(self._slots)

    def set_error_code(self, request_id: str, code: str) -> None:
        slot = self._slots.get(request_id)
        if slot is not None:
            slot.error_code = code

    def close(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            slot.leave()
        if not self._slots:
            self._empty.set()

    async def wait_empty(self, timeout_s: float) -> bool:
        """Whether every slot was closed within `timeout_s`."""
        if self._empty.is_set():
            return True
        try:
            await asyncio.wait_for(self._empty.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def publish(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            slot = self._slots.get(output.request_id)
            if slot is not None:
                slot.publish(output)

    def publish_step(self, step: StepOutputs) -> None:
        """A step's outputs: the token columns (texts filled in), then the whole outputs."""
        slot_of = self._slots.get
        for request_id, text, token_id in zip(
            step.request_ids, step.texts, step.token_ids, strict=True
        ):
            slot = slot_of(request_id)
            if slot is not None:
                slot.publish_token(text, token_id)
        self.publish(step.outputs)
