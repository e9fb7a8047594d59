"""What one apply() gives the clients: the events of a step, mostly column-wise.

Nearly every event of a decode step is "request r got token t and may show text s". Those
are three parallel columns rather than one RequestOutput each, so a step of 1,000
sequences builds three lists instead of 1,000 objects, and the output slots append to
their pending columns. Everything else (a finish with its usage, a token with logprobs,
an error) is a whole RequestOutput in `outputs`. A request appears at most once per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from pagoda.scheduler_svc.core.request import RequestOutput


@dataclass(slots=True)
class StepEvents:
    # Requests that got one token and go on: request_ids[i] got token_ids[i] and may show
    # texts[i] now ("" while a character or a possible stop string is incomplete).
    request_ids: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids) + len(self.outputs)

    def __iter__(self) -> Iterator[RequestOutput]:
        """Every event as a RequestOutput, the columns' first (for tests and tools; the
        service reads the columns)."""
        for request_id, text, token_id in zip(
            self.request_ids, self.texts, self.token_ids, strict=True
        ):
            yield RequestOutput(request_id, text, [token_id], None)
        yield from self.outputs
