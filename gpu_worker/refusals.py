"""Why the worker refuses part of a plan: one sentence per refused row or new sequence,
and the PlanError for allowed-token or draft columns that disagree with the plan.

SequenceTable.admit asks these only about a row that fails one of its quick comparisons
(about every row when some id in the plan is out of range), so the sentences, and the
order in which the checks run, live here once. `table` is the SequenceTable whose limits
apply. Imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.common.plan_check import PlanError
from pagoda.common.step import NewSequence, SamplingParams, StepPlan, num_masks

if TYPE_CHECKING:
    from pagoda.gpu_worker.sequence_table import Sequence, SequenceTable


def check_allowed_token_rows(plan: StepPlan, num_bytes: int) -> None:
    """PlanError when the allowed-token columns (`num_bytes` a mask, one mask per sample
    point of a listed row) disagree with each other or the plan. Call after
    check_draft_counts."""
    rows = plan.allowed_token_rows
    if any(b <= a for a, b in zip(rows, rows[1:], strict=False)) or not (
        rows[0] >= 0 and rows[-1] < len(plan.seq_ids)
    ):
        raise PlanError("allowed_token_rows must be ascending rows of the plan")
    if not all(plan.sample[row] for row in rows):
        raise PlanError("allowed_token_rows names a row that does not sample")
    num_points = sum(num_masks(plan.draft_counts, rows))
    if len(plan.allowed_token_bitmask) != num_points * num_bytes:
        raise PlanError(
            f"allowed_token_bitmask holds {len(plan.allowed_token_bitmask)} bytes for "
            f"{len(rows)} rows that sample {num_points} tokens, {num_bytes} bytes each"
        )


def check_draft_counts(plan: StepPlan) -> None:
    """PlanError when draft_counts is neither empty nor one count per row."""
    draft_counts = plan.draft_counts
    if len(draft_counts) != len(plan.seq_ids):
        raise PlanError(
            f"draft_counts has {len(draft_counts)} entries for {len(plan.seq_ids)} rows "
            "(none, or one per row)"
        )
    if min(draft_counts, default=0) < 0:
        raise PlanError("draft_counts holds a negative count")


def draft_problem(plan: StepPlan, row: int, *, last_sampled: bool) -> str | None:
    """Why `row` of `plan`, which has drafts (StepPlan.draft_counts), cannot sample after
    each of them what decoding one token at a time would, or None. A last_sampled row
    feeds one token, so it is named before the count."""
    seq_id, num_drafts = plan.seq_ids[row], plan.draft_counts[row]
    num_fed = plan.token_offsets[row + 1] - plan.token_offsets[row]
    if not plan.sample[row]:
        return f"sequence {seq_id} has {num_drafts} drafts in a row that does not sample"
    if last_sampled:
        return f"sequence {seq_id} has drafts in a last_sampled row"
    if num_drafts >= num_fed:
        return (
            f"sequence {seq_id} feeds {num_fed} tokens with {num_drafts} drafts "
            "(its last real token comes before them)"
        )
    return None


def new_sequence_problem(table: SequenceTable, new: NewSequence) -> str | None:
    problem = tokens_problem(table, new.cached_token_ids)
    if problem:
        return f"cached_token_ids: {problem}"
    return token_ids_problem(new, table.vocab_size) or logit_bias_problem(new.sampling)


def token_ids_problem(new: NewSequence, vocab_size: int) -> str | None:
    """Why a token id a new sequence's knobs name cannot index the logits, or None."""
    named = [*new.sampling.token_id_fields, ("min_tokens_banned_ids", new.min_tokens_banned_ids)]
    for name, token_ids in named:
        if token_ids and max(token_ids) >= vocab_size:
            return f"{name}: token id {max(token_ids)} out of range"
    return None


def tokens_problem(table: SequenceTable, token_ids) -> str | None:
    bad = [t for t in token_ids if t >= table.vocab_size]
    if bad:
        return f"token id {bad[0]} out of range (vocabulary has {table.vocab_size} tokens)"
    if len(token_ids) > table.max_context_tokens:
        return f"{len(token_ids)} tokens exceed the context of {table.max_context_tokens}"
    return None


def row_problem(
    table: SequenceTable,
    seq: Sequence | None,
    seq_id: int,
    start_position: int,
    fed: list[int],
    new_blocks: list[int],
) -> str | None:
    """Why a row cannot run (the first problem, in this order), or None."""
    if seq is None:
        return f"unknown sequence {seq_id}: neither live nor new in this plan"
    bad_blocks = [b for b in new_blocks if b >= table.num_kv_blocks]
    if bad_blocks:
        return f"block id {bad_blocks[0]} out of range (the pool has {table.num_kv_blocks} blocks)"
    if not fed:
        return f"sequence {seq_id} feeds no tokens"
    problem = tokens_problem(table, fed)
    if problem:
        return problem
    if start_position > len(seq.token_ids):
        return (
            f"sequence {seq_id} starts at position {start_position} "
            f"but only {len(seq.token_ids)} earlier tokens are known"
        )
    end_position = start_position + len(fed)
    if end_position > table.max_context_tokens:
        return f"positions up to {end_position} exceed the context of {table.max_context_tokens}"
    num_covered = (len(seq.block_ids) + len(new_blocks)) * table.block_size
    if end_position > num_covered:
        return (
            f"positions up to {end_position} are not covered by the block table "
            f"({num_covered} slots)"
        )
    return None


def last_sampled_problem(
    seq: Sequence | None, seq_id: int, start_position: int, num_fed: int
) -> str | None:
    """Why a last_sampled row cannot take the sequence's last sampled token, or None."""
    if seq is None:
        return f"unknown sequence {seq_id}: neither live nor new in this plan"
    if num_fed != 1:
        return f"sequence {seq_id} feeds {num_fed} tokens in a last_sampled row (1 expected)"
    if seq.last_sampled_position < 0:
        return f"sequence {seq_id} has sampled no token to feed"
    if start_position != seq.last_sampled_position:
        return (
            f"sequence {seq_id} feeds its last sampled token at position {start_position}, "
            f"but that token belongs at {seq.last_sampled_position}"
        )
    return None


def logit_bias_problem(sampling: SamplingParams) -> str | None:
    """Why a sequence's logit_bias columns cannot be applied (a sentence), or None; their ids
    are checked against the vocabulary with the other token-id knobs."""
    token_ids, values = sampling.logit_bias_token_ids, sampling.logit_bias_values
    if len(token_ids) != len(values):
        return f"logit_bias: {len(token_ids)} token ids for {len(values)} values"
    if len(set(token_ids)) != len(token_ids):
        return "logit_bias: a token id is listed twice"
    return None
