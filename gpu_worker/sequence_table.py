"""The worker's view of live sequences, and admitting a StepPlan as validated chunks.

The scheduler owns the truth; the worker keeps, per live sequence, only what a step
needs: the block table (append-only, grown from plan deltas), the sampling
parameters, and the token at every position fed so far (for penalties). Imports no
torch, so the weightless dummy engine validates plans with the very same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagoda.common.plan_check import PlanError, check_columns
from pagoda.common.step import NewSequence, SamplingParams, StepPlan


@dataclass(slots=True)
class Sequence:
    seq_id: int
    sampling: SamplingParams
    num_prompt_tokens: int  # tokens at positions >= this were generated
    # The ids masked until min_new_tokens tokens were generated (NewSequence's).
    min_new_tokens: int = 0
    min_tokens_banned_ids: frozenset[int] = frozenset()
    block_ids: list[int] = field(default_factory=list)  # append-only
    token_ids: list[int] = field(default_factory=list)  # token_ids[p] is the token at position p
    # The token sampled last and the position it belongs at (-1: none yet), for a plan
    # that feeds it as a placeholder (StepPlan.last_sampled_rows).
    last_sampled_token_id: int = -1
    last_sampled_position: int = -1


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens one sequence feeds in one step, at positions [start_position, end_position)."""

    seq: Sequence
    start_position: int
    token_ids: list[int]
    sample: bool
    # Structured output: the allowed tokens of the sampled one (StepPlan's bitmask row).
    allowed_token_mask: bytes | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        """Position of the token sampled after this chunk (if it samples)."""
        return self.start_position + len(self.token_ids)


@dataclass(slots=True)
class AdmittedPlan:
    step_id: int
    chunks: list[ScheduledChunk]  # the valid entries, in plan order
    refusals: dict[int, str]  # seq_id -> why it was refused (StepResult.errors)
    forget_seq_ids: list[int]  # dropped after the forward

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)


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

    def forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._sequences.pop(seq_id, None)

    def clear(self) -> None:
        self._sequences.clear()

    def admit(self, plan: StepPlan) -> AdmittedPlan:
        """Register new sequences, apply block deltas and fed tokens; refuse bad entries.

        A refused entry samples nothing and its sequence is forgotten (its block table
        would no longer match the scheduler's); every other entry runs. Raises
        PlanError when the columns themselves are inconsistent.
        """
        seq_ids = plan.seq_ids
        start_positions = plan.start_positions
        samples = plan.sample
        token_offsets = plan.token_offsets
        token_ids = plan.token_ids
        block_offsets = plan.block_offsets
        block_ids = plan.block_ids
        check_columns(
            num_entries=len(seq_ids),
            start_positions=start_positions,
            sample=samples,
            token_offsets=token_offsets,
            num_token_ids=len(token_ids),
            block_offsets=block_offsets,
            num_block_ids=len(block_ids),
        )

        refusals: dict[int, str] = {}
        last_sampled_rows = set(plan.last_sampled_rows)
        if last_sampled_rows and not all(0 <= row < len(seq_ids) for row in last_sampled_rows):
            raise PlanError("last_sampled_rows names a row the plan does not have")
        masks = self._allowed_token_masks(plan) if plan.allowed_token_rows else {}

        def refuse(seq_id: int, message: str) -> None:
            refusals[seq_id] = message
            self._sequences.pop(seq_id, None)

        for new in plan.new_sequences:
            problem = self._check_tokens(new.cached_token_ids)
            if problem:
                refuse(new.seq_id, f"cached_token_ids: {problem}")
                continue
            sampling = new.sampling
            problem = _token_ids_problem(new, self.vocab_size) or _logit_bias_problem(sampling)
            if problem:
                refuse(new.seq_id, problem)
                continue
            if sampling.num_logprobs > self.max_logprobs:
                sampling = replace(sampling, num_logprobs=self.max_logprobs)
            # A new sequence with a live id replaces it (the scheduler reused the id).
            self._sequences[new.seq_id] = Sequence(
                seq_id=new.seq_id,
                sampling=sampling,
                num_prompt_tokens=new.num_prompt_tokens,
                min_new_tokens=new.min_new_tokens,
                min_tokens_banned_ids=new.min_tokens_banned_ids,
                token_ids=list(new.cached_token_ids),
            )

        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        for i, seq_id in enumerate(seq_ids):
            if seq_id in refusals:
                continue  # already reported once
            if seq_id in scheduled:
                refuse(seq_id, f"sequence {seq_id} appears twice in the plan")
                chunks = [chunk for chunk in chunks if chunk.seq.seq_id != seq_id]
                continue
            scheduled.add(seq_id)
            fed = token_ids[token_offsets[i] : token_offsets[i + 1]]
            new_blocks = block_ids[block_offsets[i] : block_offsets[i + 1]]
            seq = self._sequences.get(seq_id)
            if i in last_sampled_rows:
                problem = _last_sampled_problem(seq, seq_id, start_positions[i], fed)
                if problem:
                    refuse(seq_id, problem)
                    continue
                fed = [seq.last_sampled_token_id]
            problem = self._check_entry(seq, seq_id, start_positions[i], fed, new_blocks)
            if problem:
                refuse(seq_id, problem)
                continue
            assert seq is not None
            seq.block_ids.extend(new_blocks)
            # Truncate then extend: a rewound start position (recompute) overwrites history.
            del seq.token_ids[start_positions[i] :]
            seq.token_ids.extend(fed)
            chunks.append(ScheduledChunk(seq, start_positions[i], fed, samples[i], masks.get(i)))

        return AdmittedPlan(
            step_id=plan.step_id,
            chunks=chunks,
            refusals=refusals,
            forget_seq_ids=plan.forget_seq_ids,
        )

    def _allowed_token_masks(self, plan: StepPlan) -> dict[int, bytes]:
        """Row index -> its allowed-token bitmask; PlanError when the columns disagree."""
        rows = plan.allowed_token_rows
        num_bytes = (self.vocab_size + 31) // 32 * 4
        if len(plan.allowed_token_bitmask) != len(rows) * num_bytes:
            raise PlanError(
                f"allowed_token_bitmask holds {len(plan.allowed_token_bitmask)} bytes for "
                f"{len(rows)} rows of {num_bytes}"
            )
        if any(b <= a for a, b in zip(rows, rows[1:], strict=False)) or not (
            rows[0] >= 0 and rows[-1] < len(plan.seq_ids)
        ):
            raise PlanError("allowed_token_rows must be ascending rows of the plan")
        if not all(plan.sample[row] for row in rows):
            raise PlanError("allowed_token_rows names a row that does not sample")
        bitmask = plan.allowed_token_bitmask
        return {row: bitmask[k * num_bytes : (k + 1) * num_bytes] for k, row in enumerate(rows)}

    @staticmethod
    def record_sampled(chunks: list[ScheduledChunk], token_ids: list[int]) -> None:
        """The tokens sampled by the chunks that sample (in order), for the next plans."""
        sampling = [chunk for chunk in chunks if chunk.sample]
        for chunk, token_id in zip(sampling, token_ids, strict=True):
            seq = chunk.seq
            seq.last_sampled_token_id = token_id
            seq.last_sampled_position = chunk.end_position

    def _check_tokens(self, token_ids) -> str | None:
        bad = [t for t in token_ids if t >= self.vocab_size]
        if bad:
            return f"token id {bad[0]} out of range (vocabulary has {self.vocab_size} tokens)"
        if len(token_ids) > self.max_context_tokens:
            return f"{len(token_ids)} tokens exceed the context of {self.max_context_tokens}"
        return None

    def _check_entry(
        self,
        seq: Sequence | None,
        seq_id: int,
        start_position: int,
        fed: list[int],
        new_blocks: list[int],
    ) -> str | None:
        if seq is None:
            return f"unknown sequence {seq_id}: neither live nor new in this plan"
        bad_blocks = [b for b in new_blocks if b >= self.num_kv_blocks]
        if bad_blocks:
            return (
                f"block id {bad_blocks[0]} out of range (the pool has {self.num_kv_blocks} blocks)"
            )
        if not fed:
            return f"sequence {seq_id} feeds no tokens"
        problem = self._check_tokens(fed)
        if problem:
            return problem
        if start_position > len(seq.token_ids):
            return (
                f"sequence {seq_id} starts at position {start_position} "
                f"but only {len(seq.token_ids)} earlier tokens are known"
            )
        end_position = start_position + len(fed)
        if end_position > self.max_context_tokens:
            return f"positions up to {end_position} exceed the context of {self.max_context_tokens}"
        num_covered = (len(seq.block_ids) + len(new_blocks)) * self.block_size
        if end_position > num_covered:
            return (
                f"positions up to {end_position} are not covered by the block table "
                f"({num_covered} slots)"
            )
        return None


def _last_sampled_problem(
    seq: Sequence | None, seq_id: int, start_position: int, fed: list[int]
) -> str | None:
    """Why a last_sampled row cannot take the sequence's last sampled token, or None."""
    if seq is None:
        return f"unknown sequence {seq_id}: neither live nor new in this plan"
    if len(fed) != 1:
        return f"sequence {seq_id} feeds {len(fed)} tokens in a last_sampled row (1 expected)"
    if seq.last_sampled_position < 0:
        return f"sequence {seq_id} has sampled no token to feed"
    if start_position != seq.last_sampled_position:
        return (
            f"sequence {seq_id} feeds its last sampled token at position {start_position}, "
            f"but that token belongs at {seq.last_sampled_position}"
        )
    return None


def _token_ids_problem(new: NewSequence, vocab_size: int) -> str | None:
    """Why a token id a new sequence's knobs name cannot index the logits, or None."""
    named = [*new.sampling.token_id_fields, ("min_tokens_banned_ids", new.min_tokens_banned_ids)]
    for name, token_ids in named:
        if token_ids and max(token_ids) >= vocab_size:
            return f"{name}: token id {max(token_ids)} out of range"
    return None


def _logit_bias_problem(sampling: SamplingParams) -> str | None:
    """Why a sequence's logit_bias columns cannot be applied (a sentence), or None."""
    token_ids, values = sampling.logit_bias_token_ids, sampling.logit_bias_values
    if len(token_ids) != len(values):
        return f"logit_bias: {len(token_ids)} token ids for {len(values)} values"
    if len(set(token_ids)) != len(token_ids):
        return "logit_bias: a token id is listed twice"
    return None
