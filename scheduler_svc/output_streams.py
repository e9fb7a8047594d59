"""Per-request output slots between the step loop and the gRPC streams.

The step loop publishes without ever awaiting: a slot merges every delta that its
reader has not taken yet into one pending output, so a slow client costs memory
proportional to its own unread tokens and never slows the loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from scheduler_svc.request import RequestOutput


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output equivalent to streaming `older` then `newer`."""
    logprobs = None
    if older.logprobs is not None or newer.logprobs is not None:
        logprobs = (older.logprobs or []) + (newer.logprobs or [])
    return RequestOutput(
        request_id=newer.request_id,
        text=older.text + newer.text,
        token_ids=older.token_ids + newer.token_ids,
        logprobs=logprobs,
        finish_reason=newer.finish_reason,
        error_message=newer.error_message,
        usage=newer.usage,
        timings=newer.timings,
    )


@dataclass(slots=True)
class OutputSlot:
    """The unread output of one request: at most one pending (coalesced) output."""

    request_id: str
    _pending: RequestOutput | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    finished: bool = False
    # The gRPC code to end with when the final output carries an error
    # (None: INTERNAL, a failure of this request alone).
    error_code: str | None = None

    def publish(self, output: RequestOutput) -> None:
        """Called by the step loop; never blocks."""
        if self.finished:
            return
        self._pending = output if self._pending is None else merge_outputs(self._pending, output)
        if output.finish_reason is not None:
            self.finished = True
        self._ready.set()

    async def next(self) -> RequestOutput:
        """Wait for, and take, everything published since the last call."""
        await self._ready.wait()
        self._ready.clear()
        output, self._pending = self._pending, None
        assert output is not None
        return output


class OutputStreams:
    """The slots of all live requests, by request id."""

    def __init__(self) -> None:
        self._slots: dict[str, OutputSlot] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def open(self, request_id: str) -> OutputSlot:
        slot = OutputSlot(request_id)
        self._slots[request_id] = slot
        return slot

    def request_ids(self) -> list[str]:
        return list(self._slots)

    def set_error_code(self, request_id: str, code: str) -> None:
        slot = self._slots.get(request_id)
        if slot is not None:
            slot.error_code = code

    def close(self, request_id: str) -> None:
        self._slots.pop(request_id, None)

    def publish(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            slot = self._slots.get(output.request_id)
            if slot is not None:
                slot.publish(output)
