"""The running set: the sequences that hold blocks, in admission order, those of them
still prefilling, and which of them decode in a step.

Decoders are fed in the reverse of preemption order (preemption.py takes the most
recently admitted), so a victim is never one already fed: oldest admission first
(priority: lowest value, then oldest). Under a decode cap they take turns, round-robin
from the one after the last served. The planner alone writes it; a request whose
sequence ends leaves it with its sequence fields cleared (`end`).
"""

from __future__ import annotations

import bisect
from operator import attrgetter

from pagoda.scheduler_svc.core.request import Request

_admit_order_of = attrgetter("admit_order")
_priority_then_admission = attrgetter("priority", "admit_order")


class RunningSet:
    def __init__(self, by_priority: bool) -> None:
        # seq_id -> request, in admission order (preemption takes from the end).
        self.requests: dict[int, Request] = {}
        # The running ones with tokens left to feed before their next sample.
        self.prefilling: dict[int, Request] = {}
        self.by_priority = by_priority
        self.feed_order = _priority_then_admission if by_priority else _admit_order_of
        self._decode_cursor = 0  # admit_order of the last sequence decoded under a cap

    def remove(self, seq_id: int) -> None:
        del self.requests[seq_id]
        self.prefilling.pop(seq_id, None)

    def end(self, request: Request) -> None:
        """`request`'s sequence ends: out of the set, its sequence fields cleared (its
        blocks were the planner's to release)."""
        self.remove(request.seq_id)
        request.block_ids = []
        request.num_blocks_sent = 0
        request.num_computed_tokens = 0
        request.seq_id = None

    def clear(self) -> None:
        self.requests.clear()
        self.prefilling.clear()

    def fed(self, request: Request) -> None:
        """`request` was fed: prefilling while it has tokens left before its next sample."""
        if request.num_tokens_to_feed:
            self.prefilling[request.seq_id] = request
        else:
            self.prefilling.pop(request.seq_id, None)

    def decoders(self, only: dict[str, Request] | None) -> list[Request]:
        """The running sequences past their prompt (of `only`'s requests), in admission
        order."""
        prefilling = self.prefilling
        if only is not None:
            return [
                request
                for seq_id, request in self.requests.items()
                if seq_id not in prefilling and request.request_id in only
            ]
        if prefilling:
            return [
                request for seq_id, request in self.requests.items() if seq_id not in prefilling
            ]
        return list(self.requests.values())

    def to_decode(self, only: dict[str, Request] | None, cap: int) -> list[Request]:
        """The decoders (of `only`'s requests) in the order to feed them: over `cap`,
        round-robin; otherwise in feed order."""
        decoders = self.decoders(only)
        if len(decoders) > cap:
            decoders = self.round_robin(decoders, cap)
        elif self.by_priority:
            decoders.sort(key=self.feed_order)
        return decoders

    def round_robin(self, decoders: list[Request], cap: int) -> list[Request]:
        """Decoders in the order to try under a cap: the `cap` after the last one served
        (decoders come in admission order), then the rest in case some are preempted."""
        start = bisect.bisect_right(decoders, self._decode_cursor, key=_admit_order_of)
        rotated = decoders[start:] + decoders[:start]
        chosen, rest = rotated[:cap], rotated[cap:]
        self._decode_cursor = chosen[-1].admit_order
        chosen.sort(key=self.feed_order)
        return chosen + rest

    def num_at_block_boundary(
        self, block_size: int, step_id: int, before: Request | None = None
    ) -> int:
        """Decoders not fed yet in step `step_id` whose next token needs a new block (with
        `before`, only those earlier than it in feed order)."""
        prefilling, feed_order = self.prefilling, self.feed_order
        rank = feed_order(before) if before is not None else None
        return sum(
            1
            for seq_id, request in self.requests.items()
            if request.num_computed_tokens % block_size == 0
            and seq_id not in prefilling
            and request.last_scheduled_step != step_id
            and (rank is None or feed_order(request) < rank)
        )
