"""Per-request output slots between the step loop and the gRPC streams.

The step loop publishes without ever awaiting: a slot appends every delta that its
reader has not taken yet to one pending output's pieces, so a slow client costs memory
proportional to its own unread tokens and never slows the loop. That is bounded: a slot
holding more than MAX_UNREAD_TOKENS unread drops them and ends its request with
RESOURCE_EXHAUSTED, a client that stopped reading (security review H1).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from pagoda.scheduler_svc.core import FinishReason, RequestOutput, StepOutputs, TokenLogprob

# Unread tokens a slot holds before its request is ended, each top-logprob alternative
# counting as one more token: about 150 KB of text, ids and logprobs. A reader that keeps
# up holds one step's tokens; only one that stopped reading gets here.
MAX_UNREAD_TOKENS = 2048
UNREAD_ERROR_CODE = "RESOURCE_EXHAUSTED"


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
    _num_unread: int = 0
    _texts: list[str] = field(default_factory=list)
    _token_ids: list[int] = field(default_factory=list)
    _logprobs: list[TokenLogprob] | None = None
    _final: RequestOutput | None = None  # the finishing output, once published
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
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
        self._num_unread += 1
        if self._num_unread > self.max_unread_tokens:
            self._overflow(None)
            return
        self._texts.append(text)
        self._token_ids.append(token_id)
        self._ready.set()

    def publish(self, output: RequestOutput) -> None:
        """Called by the step loop; never blocks."""
        if self.finished:
            return
        if self.overflowed:
            if output.finish_reason is not None:  # the end of the cancelled request
                self._overflow(output)
            return
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
        self._ready.set()

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
        self._ready.set()

    async def next(self) -> RequestOutput:
        """Wait for, and take, everything published since the last call, as one output."""
        await self._ready.wait()
        self._ready.clear()
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


class OutputStreams:
    """The slots of all live requests, by request id."""

    def __init__(
        self,
        *,
        max_unread_tokens: int = MAX_UNREAD_TOKENS,
        on_overflow: Callable[[str], None] | None = None,
    ) -> None:
        """`on_overflow(request_id)`: a running request's reader stopped reading; end it."""
        self._slots: dict[str, OutputSlot] = {}
        self._max_unread_tokens = max_unread_tokens
        self._on_overflow = on_overflow
        self._empty = asyncio.Event()  # set while no slot is open (a drain waits on it)
        self._empty.set()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def open(self, request_id: str) -> OutputSlot:
        slot = OutputSlot(
            request_id, max_unread_tokens=self._max_unread_tokens, on_overflow=self._on_overflow
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
        self._slots.pop(request_id, None)
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
