"""A step plan that no worker can run: one error type for the worker and the scheduler's fake.

The real worker raises PlanError when a plan's columns do not line up (and answers with
a step_error); the scheduler's plan-checking FakeWorker raises it for any plan a real
worker could not run correctly. `check_columns` is the framing check, over plain lists.
"""

from __future__ import annotations

from collections.abc import Sequence


class PlanError(ValueError):
    """The plan is malformed; the message is one sentence saying how."""


def check_columns(
    *,
    num_entries: int,
    start_positions: Sequence[int],
    sample: Sequence[bool],
    token_offsets: Sequence[int],
    num_token_ids: int,
    block_offsets: Sequence[int],
    num_block_ids: int,
) -> None:
    """Every per-sequence column has `num_entries` entries and the offsets frame their runs."""
    if len(start_positions) != num_entries or len(sample) != num_entries:
        raise PlanError(
            f"start_positions ({len(start_positions)}) and sample ({len(sample)}) "
            f"must have one entry per sequence ({num_entries})"
        )
    _check_offsets("token_offsets", token_offsets, num_entries, num_token_ids)
    _check_offsets("block_offsets", block_offsets, num_entries, num_block_ids)


def _check_offsets(name: str, offsets: Sequence[int], num_entries: int, num_values: int) -> None:
    if num_entries == 0 and not offsets:
        return
    if len(offsets) != num_entries + 1:
        raise PlanError(f"{name} has {len(offsets)} entries for {num_entries} sequences")
    if offsets[0] != 0 or offsets[-1] != num_values:
        raise PlanError(f"{name} must run from 0 to {num_values}")
    if any(b < a for a, b in zip(offsets, offsets[1:], strict=False)):
        raise PlanError(f"{name} must not decrease")
