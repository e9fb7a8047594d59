"""Per-request output slots between the step loop and the gRPC streams.

The step loop publishes without ever awaiting: a slot appends every delta that its
reader has not taken yet to one pending output's pieces, so a slow client costs memory
proportional to its own unread tokens and never slows the loop. That is bounded: a slot
holding more than MAX_UNREAD_TOKENS unread drops them and ends its request with
RESOURCE_EXHAUSTED, a client that stopped reading (security review H1).

Readers are let through a Turnstile a few at a time: the step loop shares its thread with
every stream writer, and waking all of a step's readers at once makes one long turn of the
event loop that the worker's next result waits behind. A reader keeps its place from its
take until it is back from writing (or the next step begins), in order, so the loop sees
the worker between writes, and a reader whose turn comes late takes several tokens as one
message: under load messages grow, instead of the worker waiting for the writers.
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
# Pending tokens all slots together hold (about 10 MB; counted as the per-slot cap counts,
# but also those waiting for the reader's turn) before the slots most behind are ended: one
# holding MIN_UNREAD_TOKENS_TO_END unread while away, or more than MAX_UNREAD_TOKENS in all.
# Without it only max_concurrent_rpcs x MAX_UNREAD_TOKENS bounded them, and one wave of
# 4,000 stalled streams added about 1 GB (security review N4); under CPU load, stalled
# streams also piled up hundreds of tokens each while waiting in the turnstile's line.
# A reader that keeps up holds a step's tokens, far fewer.
MAX_TOTAL_UNREAD_TOKENS = 128 * 1024
MIN_UNREAD_TOKENS_TO_END = 64
# Readers a Turnstile lets through at once (taking, then writing). One: a write is tens of
# microseconds of the loop, so the worker's result and new RPCs wait behind little.
# A sweep with benchmarks.overlap (dummy 10 ms steps, 256 streams, one sitting) kept the
# worker 89, 88, 88, 81, 79 and 77% busy at widths 1, 2, 4, 16, 64 and unbounded.
READERS_PER_TURN = 1


def unread_message(max_unread_tokens: int) -> str:
    return (
        f"the client left more than {max_unread_tokens} tokens unread; the request was "
        "ended and its unread output dropped"
    )


def shared_unread_message(num_unread_tokens: int) -> str:
    return (
        f"the server holds too much unread output and this client left {num_unread_tokens} "
        "tokens unread; the request was ended and its unread output dropped"
    )


@dataclass(slots=True)
class UnreadBudget:
    """The unread tokens of every slot of one OutputStreams, counted together."""

    max_tokens: int = MAX_TOTAL_UNREAD_TOKENS
    num_tokens: int = 0

    @property
    def exceeded(self) -> bool:
        return self.num_tokens > self.max_tokens


@dataclass(slots=True)
class OutputSlot:
    """The unread output of one request, kept as the pieces of one coalesced output."""

    request_id: str
    max_unread_tokens: int = MAX_UNREAD_TOKENS
    # Called once when the slot overflows before its request finished, to end the
    # request (the step loop's cancel); not called for a finished one.
    on_overflow: Callable[[str], None] | None = None
    overflowed: bool = False
    budget: UnreadBudget = field(default_factory=UnreadBudget)  # shared by a stream's slots
    # Every pending token, unread or on its way to a waiting reader: its share of `budget`.
    _num_pending: int = 0
    _unread_sentence: str = ""  # why it overflowed, once it did
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
    # Took its output and is writing it, holding its place (see Turnstile.end_holds).
    _holding: bool = False
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
        self._add_pending(1, away=not self._waiting)
        if self._over_budget():
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
        num_tokens = len(output.token_ids)
        for logprob in output.logprobs or ():
            num_tokens += len(logprob.top_token_ids)
        self._add_pending(num_tokens, away=not self._waiting)
        if self._over_budget():
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

    def _add_pending(self, num_tokens: int, *, away: bool) -> None:
        if away:  # published while the reader was away: unread by its client
            self._num_unread += num_tokens
        self._num_pending += num_tokens
        self.budget.num_tokens += num_tokens

    def _clear_unread(self) -> None:
        self.budget.num_tokens -= self._num_pending
        self._num_unread = self._num_pending = 0

    def _over_budget(self) -> bool:
        """Beyond this slot's own bound, or a large share of the stream's shared one."""
        if self._num_unread > self.max_unread_tokens:
            self._unread_sentence = self._unread_sentence or unread_message(self.max_unread_tokens)
            return True
        if self.budget.exceeded and (
            self._num_unread >= MIN_UNREAD_TOKENS_TO_END
            or self._num_pending > self.max_unread_tokens
        ):
            self._unread_sentence = self._unread_sentence or shared_unread_message(
                self._num_pending
            )
            return True
        return False

    def _overflow(self, final: RequestOutput | None) -> None:
        """Drop everything unread; end with an error once the request's end is here
        (`final`), asking for that end first if it is not."""
        self._texts, self._token_ids, self._logprobs = [], [], None
        self._clear_unread()
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
            error_message=self._unread_sentence or unread_message(self.max_unread_tokens),
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
        """The reader is gone: give up the slot's place in the turnstile's line, and its
        unread tokens' share of the budget."""
        self._clear_unread()
        self._end_hold()
        if self._in_line:
            self._in_line = False
            if self._ready.is_set():  # woken, never taken: its pass ends here
                assert self.turnstile is not None
                self.turnstile.passed()

    def _end_hold(self) -> None:
        if self._holding:
            self._holding = False
            assert self.turnstile is not None
            self.turnstile.passed()

    async def next(self) -> RequestOutput:
        """Wait for, and take, everything published since the last call, as one output."""
        while True:
            self._end_hold()  # back from writing the last output, or woken for nothing
            self._waiting = True
            try:
                await self._ready.wait()
            finally:
                self._waiting = False
            self._ready.clear()
            if self._in_line:  # the place is kept while the output is written
                self._in_line = False
                self._holding = True
                assert self.turnstile is not None
                self.turnstile.hold(self)
            if self.has_pending:
                break
            # Woken for output that an overflow has dropped since: the request's end
            # (an error) comes next.
            assert self.overflowed
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
            output.tool_calls = final.tool_calls
        self._texts, self._token_ids, self._logprobs, self._final = [], [], None, None
        self._clear_unread()
        return output


class Turnstile:
    """Wakes the readers of slots with pending output in the order their output came, at
    most `width` holding a place at once: from its wake until it is back for more (its
    write done), or until end_holds (the next step) for one still writing."""

    def __init__(self, width: int = READERS_PER_TURN) -> None:
        if width < 1:
            raise ValueError("a turnstile lets at least one reader through")
        self._width = width
        self._num_passing = 0  # woken and not back from writing what they took
        self._holders: list[OutputSlot] = []
        self._line: deque[OutputSlot] = deque()

    def enter(self, slot: OutputSlot) -> None:
        if self._num_passing < self._width:
            self._wake(slot)
        else:
            self._line.append(slot)

    def passed(self) -> None:
        """A reader is back from writing, lost its hold, or left: the next one goes through."""
        self._num_passing -= 1
        line = self._line
        while line and self._num_passing < self._width:
            slot = line.popleft()
            if slot._in_line:  # else it left while waiting in line
                self._wake(slot)

    def hold(self, slot: OutputSlot) -> None:
        self._holders.append(slot)

    def end_holds(self) -> None:
        """A new step's outputs: places held by readers still writing are given back. A
        reader holds its place from its take until it is back for more, so writes go a few
        at a time and messages grow under load; but one whose client stopped reading never
        comes back, and must not keep the line waiting beyond this step."""
        holders, self._holders = self._holders, []
        for slot in holders:
            slot._end_hold()

    def _wake(self, slot: OutputSlot) -> None:
        if slot._waiting:  # it takes in the next turn and holds the place while it writes
            self._num_passing += 1
        else:  # busy writing: it takes when it is back, without a place
            slot._in_line = False
        slot._ready.set()


class OutputStreams:
    """The slots of all live requests, by request id."""

    def __init__(
        self,
        *,
        max_unread_tokens: int = MAX_UNREAD_TOKENS,
        max_total_unread_tokens: int = MAX_TOTAL_UNREAD_TOKENS,
        on_overflow: Callable[[str], None] | None = None,
        readers_per_turn: int = READERS_PER_TURN,
    ) -> None:
        """`on_overflow(request_id)`: a running request's reader stopped reading; end it."""
        self._slots: dict[str, OutputSlot] = {}
        self._max_unread_tokens = max_unread_tokens
        self.budget = UnreadBudget(max_total_unread_tokens)
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
            budget=self.budget,
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

    def end_holds(self) -> None:
        """Give back the places of readers still writing (Turnstile.end_holds): at each
        step, and while the step loop idles (no step would come to do it)."""
        self._turnstile.end_holds()

    def publish_step(self, step: StepOutputs) -> None:
        """A step's outputs: the token columns (texts filled in), then the whole outputs."""
        self.end_holds()
        slot_of = self._slots.get
        for request_id, text, token_id in zip(
            step.request_ids, step.texts, step.token_ids, strict=True
        ):
            slot = slot_of(request_id)
            if slot is not None:
                slot.publish_token(text, token_id)
        self.publish(step.outputs)
