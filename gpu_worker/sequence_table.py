"""The worker's view of live sequences, and admitting a StepPlan: validated, still columns.

The scheduler owns the truth; the worker keeps, per live sequence, only what a step
needs: the block table (append-only, grown from plan deltas), the sampling
parameters, and the token at every position fed so far (for penalties). Admitting a
plan returns it as the same column-wise StepPlan (refused rows dropped, placeholders
filled in), so every consumer reads columns and looks sequences up here by seq_id.
Imports no torch, so the weightless dummy engine validates plans with the very same code.

A step launched ahead (engine.py) is admitted before the step before it is read back: a
placeholder row whose token that step has not read yet feeds PENDING_TOKEN, which the
engine replaces on the device with the token sampled there, and the history holds
PENDING_TOKEN at that position until `record_sampled` writes the token in.

A row with d drafts (StepPlan.draft_counts) samples d + 1 tokens, one after each of its
last d + 1 fed tokens: `sampling_rows` lists one sample point per token, so the logits,
the sampler and the result have a row per point. The history holds the drafts at their
positions; the scheduler keeps the samples that match them plus one, and its next plan
starts where those end, which truncates the rejected drafts away (admit's "truncate then
extend"; their K/V is overwritten the same way).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from pagoda.common.plan_check import PlanError, check_columns
from pagoda.common.step import SamplingParams, StepMasks, StepPlan, mask_words, num_masks
from pagoda.gpu_worker.refusals import (
    check_allowed_token_rows,
    check_draft_counts,
    draft_problem,
    last_sampled_problem,
    new_sequence_problem,
    row_problem,
)

# The token of a placeholder row whose sampling step is enqueued but not read back yet.
PENDING_TOKEN = -2  # -1: no token sampled yet


@dataclass(slots=True)
class Sequence:
    seq_id: int
    sampling: SamplingParams
    num_prompt_tokens: int  # tokens at positions >= this were generated
    block_ids: list[int] = field(default_factory=list)  # append-only
    token_ids: list[int] = field(default_factory=list)  # token_ids[p] is the token at position p
    # The ids masked until min_new_tokens tokens were generated (NewSequence's).
    min_new_tokens: int = 0
    min_tokens_banned_ids: frozenset[int] = frozenset()
    # The token sampled last and the position it belongs at (-1: none yet), for a plan
    # that feeds it as a placeholder (StepPlan.last_sampled_rows); PENDING_TOKEN while its
    # step is enqueued and not read back (expect_sampled).
    last_sampled_token_id: int = -1
    last_sampled_position: int = -1


@dataclass(slots=True)
class SamplingRows:
    """What an admitted plan samples, in plan order (the result's), with what sampling
    reads: one sample point per row that samples, d + 1 consecutive ones for a row with
    d drafts (after each of its last d + 1 fed tokens, in position order)."""

    rows: list[int]  # each point's plan row
    sequences: list[Sequence]
    positions: list[int]  # each point's sampled token's position (the fed one before it + 1)
    # Sample point (an index into rows) -> its allowed-token bitmask; constrained only.
    masks: dict[int, bytes]
    # Sequences whose row has drafts: which of their samples is the last token is the
    # scheduler's choice, so the worker knows none to feed as a placeholder.
    drafted_seq_ids: set[int] = field(default_factory=set)


class SequenceTable:
    """Live sequences by id. Called only from the worker's step loop."""

    def __init__(
        self,
        *,
        num_kv_blocks: int,
        block_size: int,
        vocab_size: int,
        max_context_tokens: int,
        max_logprobs: int,
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_context_tokens = max_context_tokens
        self.max_logprobs = max_logprobs
        self._sequences: dict[int, Sequence] = {}

    def __len__(self) -> int:
        return len(self._sequences)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._sequences

    def get(self, seq_id: int) -> Sequence | None:
        return self._sequences.get(seq_id)

    def sequences_of(self, seq_ids: list[int]) -> list[Sequence]:
        """The live sequence of each id, in order (an admitted plan's rows: all live)."""
        return list(map(self._sequences.__getitem__, seq_ids))

    def forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._sequences.pop(seq_id, None)

    def clear(self) -> None:
        self._sequences.clear()

    def admit(self, plan: StepPlan) -> tuple[StepPlan, dict[int, str]]:
        """Register new sequences, apply block deltas and fed tokens; refuse bad rows.

        Returns the plan to run and the refusals. The plan is `plan` itself when every
        row is valid and none is a placeholder; otherwise a copy without the refused
        rows (allowed_token_rows renumbered, draft_counts kept per row) and with each
        last_sampled row's token in token_ids (its last_sampled_rows then empty). A
        refused row samples nothing and its sequence is forgotten (its block table would
        no longer match the scheduler's). Raises PlanError when the columns themselves
        are inconsistent.
        """
        seq_ids = plan.seq_ids
        start_positions = plan.start_positions
        token_offsets = plan.token_offsets
        token_ids = plan.token_ids
        block_offsets = plan.block_offsets
        block_ids = plan.block_ids
        check_columns(
            num_entries=len(seq_ids),
            start_positions=start_positions,
            sample=plan.sample,
            token_offsets=token_offsets,
            num_token_ids=len(token_ids),
            block_offsets=block_offsets,
            num_block_ids=len(block_ids),
        )
        last_sampled_rows = set(plan.last_sampled_rows)
        if last_sampled_rows and not all(0 <= row < len(seq_ids) for row in last_sampled_rows):
            raise PlanError("last_sampled_rows names a row the plan does not have")
        draft_counts = plan.draft_counts
        if draft_counts:
            check_draft_counts(plan)
        if plan.allowed_token_rows:
            check_allowed_token_rows(plan, allowed_token_mask_bytes(self.vocab_size))

        refusals: dict[int, str] = {}  # seq_id -> why (StepResult.errors)

        def refuse(seq_id: int, message: str) -> None:
            refusals[seq_id] = message
            self._sequences.pop(seq_id, None)

        for new in plan.new_sequences:
            problem = new_sequence_problem(self, new)
            if problem:
                refuse(new.seq_id, problem)
                continue
            sampling = new.sampling
            if sampling.num_logprobs > self.max_logprobs:
                sampling = replace(sampling, num_logprobs=self.max_logprobs)
            # A new sequence with a live id replaces it (the scheduler reused the id).
            self._sequences[new.seq_id] = Sequence(
                seq_id=new.seq_id,
                sampling=sampling,
                num_prompt_tokens=new.num_prompt_tokens,
                token_ids=list(new.cached_token_ids),
                min_new_tokens=new.min_new_tokens,
                min_tokens_banned_ids=new.min_tokens_banned_ids,
            )

        # The fed tokens, placeholders filled in (a copy: the caller's plan is not written).
        fed_ids = list(token_ids) if last_sampled_rows else token_ids
        # Ids out of range are rare: when there are none, a row is checked with a few
        # comparisons, and row_problem (the sentences) runs only for one that fails.
        ids_in_range = (not token_ids or max(token_ids) < self.vocab_size) and (
            not block_ids or max(block_ids) < self.num_kv_blocks
        )
        sequences = self._sequences
        block_size = self.block_size
        max_context_tokens = self.max_context_tokens
        scheduled: set[int] = set()
        for i, seq_id in enumerate(seq_ids):
            if seq_id in refusals:
                continue  # already reported once
            if seq_id in scheduled:
                refuse(seq_id, f"sequence {seq_id} appears twice in the plan")
                continue  # its earlier row is dropped with it
            scheduled.add(seq_id)
            start = start_positions[i]
            first, last = token_offsets[i], token_offsets[i + 1]
            first_block, last_block = block_offsets[i], block_offsets[i + 1]
            seq = sequences.get(seq_id)
            placeholder = i in last_sampled_rows
            if draft_counts and draft_counts[i] and seq is not None:
                problem = draft_problem(plan, i, last_sampled=placeholder)
                if problem:
                    refuse(seq_id, problem)
                    continue
            if placeholder:
                problem = last_sampled_problem(seq, seq_id, start, last - first)
                if problem:
                    refuse(seq_id, problem)
                    continue
                fed_ids[first] = seq.last_sampled_token_id
            end = start + last - first
            if (
                not ids_in_range
                or seq is None
                or last == first
                or end > max_context_tokens
                or not 0 <= start <= len(seq.token_ids)
                or end > (len(seq.block_ids) + last_block - first_block) * block_size
                or (placeholder and fed_ids[first] >= self.vocab_size)
            ):
                problem = row_problem(
                    self, seq, seq_id, start, fed_ids[first:last], block_ids[first_block:last_block]
                )
                if problem:
                    refuse(seq_id, problem)
                    continue
            if last_block > first_block:
                seq.block_ids.extend(block_ids[first_block:last_block])
            history = seq.token_ids
            if last - first == 1 and start == len(history):
                history.append(fed_ids[first])
            else:
                # Truncate then extend: a rewound start position (recompute) overwrites history.
                del history[start:]
                history.extend(fed_ids[first:last])

        if refusals:
            return _without_rows(plan, fed_ids, refusals.keys()), refusals
        if last_sampled_rows:
            return replace(plan, token_ids=fed_ids, last_sampled_rows=[]), refusals
        return plan, refusals

    def sampling_rows(self, plan: StepPlan, *, with_masks: bool = True) -> SamplingRows:
        """The sample points of an admitted plan (SamplingRows), their sequences, positions
        and (unless not `with_masks`) allowed-token masks."""
        rows = [i for i, sample in enumerate(plan.sample) if sample]
        offsets, starts = plan.token_offsets, plan.start_positions
        positions = [starts[i] + offsets[i + 1] - offsets[i] for i in rows]
        draft_counts = plan.draft_counts
        drafted_rows = [i for i in rows if draft_counts[i]] if draft_counts else []
        if drafted_rows:
            positions = spread_drafts(positions, rows, draft_counts)
            rows = [i for i in rows for _ in range(draft_counts[i] + 1)]
        masks: dict[int, bytes] = {}
        if with_masks and plan.allowed_token_rows:
            # Each constrained row's masks, taken in the order of its points.
            row_masks = {
                row: iter(row_points)
                for row, row_points in allowed_token_masks(plan, self.vocab_size).items()
            }
            for point, row in enumerate(rows):
                if row in row_masks:
                    masks[point] = next(row_masks[row])
        return SamplingRows(
            rows=rows,
            sequences=self.sequences_of([plan.seq_ids[i] for i in rows]),
            positions=positions,
            masks=masks,
            drafted_seq_ids={plan.seq_ids[i] for i in drafted_rows},
        )

    def expect_sampled(self, sampling: SamplingRows) -> None:
        """The sample points of an admitted plan (sampling_rows) are enqueued: a plan
        launched before they are read back may feed their tokens, as PENDING_TOKEN; a
        sequence whose row has drafts has no token to feed (last_sampled_problem)."""
        drafted = sampling.drafted_seq_ids
        for seq, position in zip(sampling.sequences, sampling.positions, strict=True):
            if seq.seq_id in drafted:
                seq.last_sampled_token_id = seq.last_sampled_position = -1
            else:
                seq.last_sampled_token_id = PENDING_TOKEN
                seq.last_sampled_position = position

    def record_sampled(self, sampling: SamplingRows, token_ids: list[int]) -> None:
        """The tokens sampled at an admitted plan's sample points (sampling_rows, in
        order), for the next plans; written into the history where a plan launched ahead
        fed them as PENDING_TOKEN. Not those of a sequence whose row has drafts: it keeps
        no last token (expect_sampled), and no plan fed its samples as placeholders."""
        drafted = sampling.drafted_seq_ids
        for seq, position, token_id in zip(
            sampling.sequences, sampling.positions, token_ids, strict=True
        ):
            if seq.seq_id in drafted:
                continue
            # Unless a step launched since expects another token (not read yet either).
            if seq.last_sampled_token_id != PENDING_TOKEN or seq.last_sampled_position == position:
                seq.last_sampled_token_id = token_id
                seq.last_sampled_position = position
            history = seq.token_ids
            if position < len(history) and history[position] == PENDING_TOKEN:
                history[position] = token_id


def spread_drafts(values: list[int], rows: list[int], draft_counts: list[int]) -> list[int]:
    """Per sampling row rows[k], whose last fed token has values[k] (a position, a packed
    index), the values of the tokens it samples after: values[k] - d .. values[k] for a
    row with d drafts (its last d + 1 fed tokens, in order)."""
    spread: list[int] = []
    for row, value in zip(rows, values, strict=True):
        num_drafts = draft_counts[row]
        spread.extend(range(value - num_drafts, value + 1))
    return spread


def allowed_token_mask_bytes(vocab_size: int) -> int:
    """Bytes of one row's allowed-token bitmask: ceil(vocab / 32) 32-bit words."""
    return mask_words(vocab_size) * 4


def allowed_token_masks(plan: StepPlan, vocab_size: int) -> dict[int, list[bytes]]:
    """Row -> its allowed-token bitmasks (one per sample point, in their order), for an
    admitted plan's constrained rows."""
    num_bytes = allowed_token_mask_bytes(vocab_size)
    bitmask = plan.allowed_token_bitmask
    masks: dict[int, list[bytes]] = {}
    start = 0
    for row, count in zip(
        plan.allowed_token_rows, num_masks(plan.draft_counts, plan.allowed_token_rows), strict=True
    ):
        masks[row] = [
            bitmask[start + k * num_bytes : start + (k + 1) * num_bytes] for k in range(count)
        ]
        start += count * num_bytes
    return masks


def follow_up_masks(
    plan: StepPlan, masks: StepMasks, vocab_size: int, sampling: SamplingRows
) -> dict[int, bytes]:
    """Sample point (of `sampling`, the admitted plan's) -> its allowed-token bitmask, for
    the sequences `masks` (the StepMasks that follow the plan) names; one the plan does
    not sample (a row refused at admit) is skipped. PlanError when the bitmask's length
    does not fit its sequence ids, or names a row with drafts (it has several points)."""
    num_bytes = allowed_token_mask_bytes(vocab_size)
    bitmask = masks.allowed_token_bitmask
    if len(bitmask) != len(masks.seq_ids) * num_bytes:
        raise PlanError(
            f"the masks of step {masks.step_id} hold {len(bitmask)} bytes for "
            f"{len(masks.seq_ids)} sequences of {num_bytes}"
        )
    point_of = {plan.seq_ids[row]: point for point, row in enumerate(sampling.rows)}
    drafted = [seq_id for seq_id in masks.seq_ids if seq_id in sampling.drafted_seq_ids]
    if drafted:
        raise PlanError(
            f"the masks of step {masks.step_id} constrain sequence {drafted[0]}, "
            "whose row has drafts"
        )
    return {
        point_of[seq_id]: bitmask[k * num_bytes : (k + 1) * num_bytes]
        for k, seq_id in enumerate(masks.seq_ids)
        if seq_id in point_of
    }


def _without_rows(plan: StepPlan, fed_ids: list[int], refused) -> StepPlan:
    """A copy of `plan` without the rows of `refused` sequences; token_ids from `fed_ids`
    (placeholders filled in)."""
    kept = [i for i, seq_id in enumerate(plan.seq_ids) if seq_id not in refused]
    token_offsets, block_offsets = plan.token_offsets, plan.block_offsets
    valid = StepPlan(
        step_id=plan.step_id,
        new_sequences=[new for new in plan.new_sequences if new.seq_id not in refused],
        seq_ids=[plan.seq_ids[i] for i in kept],
        start_positions=[plan.start_positions[i] for i in kept],
        sample=[plan.sample[i] for i in kept],
        token_offsets=[0] if kept else [],
        block_offsets=[0] if kept else [],
        forget_seq_ids=plan.forget_seq_ids,
        masks_follow=plan.masks_follow,
        draft_counts=[plan.draft_counts[i] for i in kept] if plan.draft_counts else [],
    )
    for i in kept:
        valid.token_ids.extend(fed_ids[token_offsets[i] : token_offsets[i + 1]])
        valid.token_offsets.append(len(valid.token_ids))
        valid.block_ids.extend(plan.block_ids[block_offsets[i] : block_offsets[i + 1]])
        valid.block_offsets.append(len(valid.block_ids))
    rows = plan.allowed_token_rows
    if rows:
        counts = num_masks(plan.draft_counts, rows)
        num_bytes = len(plan.allowed_token_bitmask) // sum(counts)  # admit checked the length
        row_of = {i: k for k, i in enumerate(kept)}
        bitmask = plan.allowed_token_bitmask
        starts = [0, *itertools.accumulate(count * num_bytes for count in counts)]
        kept_rows = [k for k, row in enumerate(rows) if row in row_of]
        valid.allowed_token_rows = [row_of[rows[k]] for k in kept_rows]
        valid.allowed_token_bitmask = b"".join(
            bitmask[starts[k] : starts[k + 1]] for k in kept_rows
        )
    return valid
