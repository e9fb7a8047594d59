"""An in-process worker with `--model dummy` semantics, for tests and benchmarks.

Each sampling sequence gets `dummy_next_token(last fed token, its position, vocab)`
(skipping the ending ids until min_new_tokens, as a worker masks them),
exactly what the real dummy worker answers, so a preempted request recomputes to the
same output. With `check=True` it also verifies what a real worker relies on and raises
PlanError on the first violation, so scheduler bugs surface where they happen:
  - columns are well formed; sequences are new exactly once and unknown ones are errors;
  - block ids are in range and a sequence's table covers every position it feeds;
  - positions are fed contiguously, within the context;
  - every K/V slot a sequence reads holds that sequence's own prefix: a slot is modelled
    as a hash of all tokens up to it, so sharing a block with different content, or
    overwriting a slot another live sequence still reads, is caught.
A sequence feeding a token id outside the vocabulary, or named in `refuse`, is refused as
the real worker refuses it (an entry in `errors`, nothing written, forgotten). A new
sequence of the same step that points at blocks the refused one was to write reads
garbage, as it would on a GPU: it samples a wrong token, and feeding it again is a
PlanError (the scheduler must recompute it). With `overlapped`, except in the very next
step: an overlapped scheduler planned it before the result was known, so there a refused
sequence is refused again (the real worker's "unknown sequence"), a garbage one stays
garbage, and a new sequence reading the blocks left unwritten reads garbage too.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from pagoda.common.dummy_tokens import dummy_banned_token_ids, dummy_next_token
from pagoda.common.plan_check import PlanError
from pagoda.common.step import StepPlan, StepResult, WorkerGeometry
from pagoda.scheduler_svc.core.speculation import num_kept


@dataclass(slots=True)
class _Sequence:
    num_logprobs: int
    num_prompt_tokens: int = 0
    min_new_tokens: int = 0  # the ending ids below are masked until then, as on a worker
    min_tokens_banned_ids: frozenset[int] = frozenset()
    block_ids: list[int] = field(default_factory=list)
    block_index: dict[int, int] = field(default_factory=dict)  # block id -> index in table
    num_positions: int = 0  # positions whose K/V this sequence has (fed or cached)
    prefix_hash: int = 0  # content hash of its K/V up to num_positions
    garbage: bool = False  # it read K/V that nobody wrote (a refused writer's)
    garbage_step: int = 0  # the worker's step count when it became garbage
    # (token id, its position) of the last token sampled, for StepPlan.last_sampled_rows.
    last_sampled: tuple[int, int] | None = None


class FakeWorker:
    def __init__(
        self,
        geometry: WorkerGeometry,
        *,
        check: bool = True,
        overlapped: bool = False,
        next_token: Callable[..., int] = dummy_next_token,
    ) -> None:
        self.geometry = geometry
        # The model: dummy_next_token's signature (a test may model repetitive output).
        self.next_token = next_token
        self.check = check
        self.overlapped = overlapped  # the next plan may be made before a result is applied
        self._sequences: dict[int, _Sequence] = {}
        self._ever_seen: set[int] = set()
        # (block id, offset) -> content hash of the K/V written there (check mode only).
        self._slots: dict[tuple[int, int], int] = {}
        self._holders: dict[int, set[int]] = {}  # block id -> live seq ids holding it
        # Blocks the step running was to write but does not: a refused (or garbage) writer's.
        self._unwritten: set[int] = set()
        # The step before's refused sequences and unwritten blocks (see the docstring).
        self._refused: dict[int, _Sequence] = {}
        self._refused_before: dict[int, _Sequence] = {}
        self._unwritten_before: set[int] = set()
        self.num_unknown_forgets = 0
        self.num_steps = 0

    @property
    def live_seq_ids(self) -> set[int]:
        return set(self._sequences)

    def step(self, plan: StepPlan, refuse: Collection[int] = ()) -> StepResult:
        """Run one plan: append blocks, "write" K/V, sample, then forget. Sequences in
        `refuse` (and any feeding an id outside the vocabulary) are refused."""
        self.num_steps += 1
        check = self.check
        if check:
            self._check_columns(plan)
        vocab_size = self.geometry.vocab_size
        offsets = plan.token_offsets
        refused = set(refuse)
        for index, seq_id in enumerate(plan.seq_ids):
            fed = plan.token_ids[offsets[index] : offsets[index + 1]]
            if fed and max(fed) >= vocab_size:
                refused.add(seq_id)
        for new in plan.new_sequences:
            if new.cached_token_ids and max(new.cached_token_ids) >= vocab_size:
                refused.add(new.seq_id)
        if self.overlapped:
            self._refused_before, self._refused = self._refused, {}
            self._unwritten_before, self._unwritten = self._unwritten, set()
        else:
            self._unwritten.clear()
        for new in plan.new_sequences:
            if new.seq_id in self._ever_seen:
                raise PlanError(f"seq {new.seq_id} announced as new twice")
            self._ever_seen.add(new.seq_id)
            sequence = _Sequence(
                num_logprobs=new.sampling.num_logprobs,
                num_prompt_tokens=new.num_prompt_tokens,
                min_new_tokens=new.min_new_tokens,
                min_tokens_banned_ids=new.min_tokens_banned_ids,
            )
            sequence.num_positions = len(new.cached_token_ids)
            self._sequences[new.seq_id] = sequence
        cached_of = {new.seq_id: new.cached_token_ids for new in plan.new_sequences}

        # Forgets happen after the forward, so their blocks may be reused in this plan.
        forgetting = set(plan.forget_seq_ids)
        result = StepResult(step_id=plan.step_id, seq_ids=[], token_ids=[])
        token_ids = self._substitute_last_sampled(plan)
        want_logprobs = False
        sampled: list[_Sequence] = []
        for index, seq_id in enumerate(plan.seq_ids):
            sequence = self._sequences.get(seq_id)
            if sequence is None:
                sequence = self._refused_before.get(seq_id)
                if sequence is None:
                    raise PlanError(f"step {plan.step_id} feeds unknown seq {seq_id}")
                refused.add(seq_id)
            new_block_ids = plan.block_ids[
                plan.block_offsets[index] : plan.block_offsets[index + 1]
            ]
            start = plan.start_positions[index]
            fed = token_ids[offsets[index] : offsets[index + 1]]
            if seq_id in refused:
                if self._sequences.pop(seq_id, None) is not None:
                    if self.overlapped:
                        self._refused[seq_id] = sequence
                    for block_id in sequence.block_ids:
                        self._holders[block_id].discard(seq_id)
                table = sequence.block_ids = sequence.block_ids + new_block_ids
                block_size = self.geometry.block_size
                end = start + len(fed)
                self._unwritten.update(table[start // block_size : -(-end // block_size)])
                result.errors[seq_id] = "refused: token id out of range or told to"
                continue
            if sequence.garbage and not (
                self.overlapped and sequence.garbage_step == self.num_steps - 1
            ):
                raise PlanError(f"step {plan.step_id} feeds seq {seq_id}, whose K/V is garbage")
            self._append_blocks(seq_id, sequence, new_block_ids)
            if check and seq_id in cached_of:
                self._check_cached(seq_id, sequence, cached_of[seq_id])
            if check:
                self._check_feed(plan.step_id, seq_id, sequence, start, len(fed))
                if sequence.garbage:
                    self._unwritten.update(sequence.block_ids)
                else:
                    self._write(seq_id, sequence, start, fed, forgetting)
            sequence.num_positions = start + len(fed)
            num_drafts = plan.draft_counts[index] if plan.draft_counts else 0
            if plan.sample[index]:
                # After each fed token from the last real one on (one: no drafts).
                samples = []
                for last_position in range(start + len(fed) - 1 - num_drafts, start + len(fed)):
                    banned = dummy_banned_token_ids(
                        last_position,
                        sequence.num_prompt_tokens,
                        sequence.min_new_tokens,
                        sequence.min_tokens_banned_ids,
                    )
                    token_id = self.next_token(
                        fed[last_position - start], last_position, vocab_size, banned
                    )
                    if sequence.garbage:
                        token_id = (token_id + 1) % vocab_size  # what garbage K/V samples
                    result.seq_ids.append(seq_id)
                    result.token_ids.append(token_id)
                    sampled.append(sequence)
                    samples.append(token_id)
                sequence.last_sampled = (token_id, last_position + 1)
                want_logprobs = want_logprobs or sequence.num_logprobs > 0
                if num_drafts:
                    self._keep_accepted(sequence, plan.drafts(index), samples)
            elif num_drafts:
                raise PlanError(f"step {plan.step_id}: seq {seq_id} has drafts but samples none")
        if want_logprobs:
            self._fill_logprobs(result, sampled)
        for seq_id in plan.forget_seq_ids:
            sequence = self._sequences.pop(seq_id, None)
            if sequence is None:
                self.num_unknown_forgets += 1
                continue
            for block_id in sequence.block_ids:
                self._holders[block_id].discard(seq_id)
        return result

    def _keep_accepted(self, sequence: _Sequence, drafts: list[int], samples: list[int]) -> None:
        """A drafted row: its K/V holds only up to the last accepted draft (the scheduler's
        next feed of it must start there), and its last sample is not known here."""
        num_rejected = len(drafts) + 1 - num_kept(drafts, samples)
        sequence.num_positions -= num_rejected
        sequence.last_sampled = None
        if self.check:
            position = sequence.num_positions - 1
            block_size = self.geometry.block_size
            slot = (sequence.block_ids[position // block_size], position % block_size)
            sequence.prefix_hash = self._slots[slot]

    def fail(self, plan: StepPlan, message: str = "injected failure") -> StepResult:
        """A failed step as the real worker reports it: it forgets every sequence named."""
        for seq_id in [*plan.seq_ids, *plan.forget_seq_ids]:
            sequence = self._sequences.pop(seq_id, None)
            if sequence is not None:
                for block_id in sequence.block_ids:
                    self._holders[block_id].discard(seq_id)
        self._ever_seen.update(new.seq_id for new in plan.new_sequences)
        return StepResult(step_id=plan.step_id, seq_ids=[], token_ids=[], step_error=message)

    def _substitute_last_sampled(self, plan: StepPlan) -> list[int]:
        """The plan's token ids, each last_sampled row's placeholder replaced by the token
        its sequence sampled last (overlapped steps), as the real worker does; a row whose
        sequence has no such token at that position is a PlanError."""
        if not plan.last_sampled_rows:
            return plan.token_ids
        token_ids = list(plan.token_ids)
        for row in plan.last_sampled_rows:
            seq_id = plan.seq_ids[row]
            sequence = self._sequences.get(seq_id)
            if sequence is None and seq_id in self._refused_before:
                continue  # refused again below
            last = sequence.last_sampled if sequence is not None else None
            start, end = plan.token_offsets[row], plan.token_offsets[row + 1]
            if last is None or end - start != 1 or last[1] != plan.start_positions[row]:
                raise PlanError(
                    f"step {plan.step_id}: seq {seq_id} feeds a last sampled token at position "
                    f"{plan.start_positions[row]}, but its last sample is {last}"
                )
            token_ids[start] = last[0]
        return token_ids

    def block_ids_of(self, seq_id: int) -> list[int]:
        return list(self._sequences[seq_id].block_ids)

    # -- checks ----------------------------------------------------------------------------

    def _check_columns(self, plan: StepPlan) -> None:
        num_seqs = len(plan.seq_ids)
        for name in ("start_positions", "sample"):
            if len(getattr(plan, name)) != num_seqs:
                raise PlanError(
                    f"{name} has {len(getattr(plan, name))} entries for {num_seqs} seqs"
                )
        for name, values in (("token", plan.token_ids), ("block", plan.block_ids)):
            offsets = getattr(plan, f"{name}_offsets")
            if len(offsets) != num_seqs + 1 or offsets[0] != 0 or offsets[-1] != len(values):
                raise PlanError(f"{name}_offsets {offsets} do not frame {len(values)} ids")
            if any(b < a for a, b in zip(offsets, offsets[1:], strict=False)):
                raise PlanError(f"{name}_offsets decrease: {offsets}")
        if plan.draft_counts and len(plan.draft_counts) != num_seqs:
            raise PlanError(f"draft_counts has {len(plan.draft_counts)} entries for {num_seqs}")
        if len(set(plan.seq_ids)) != num_seqs:
            raise PlanError(f"a seq is fed twice in step {plan.step_id}")
        for index in range(num_seqs):
            if plan.token_offsets[index] == plan.token_offsets[index + 1]:
                raise PlanError(f"seq {plan.seq_ids[index]} is scheduled with no tokens")
        for block_id in plan.block_ids:
            if not 0 <= block_id < self.geometry.num_kv_blocks:
                raise PlanError(f"block {block_id} is outside the pool")

    def _append_blocks(self, seq_id: int, sequence: _Sequence, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self.check and block_id in sequence.block_index:
                raise PlanError(f"seq {seq_id} holds block {block_id} twice")
            sequence.block_index[block_id] = len(sequence.block_ids)
            sequence.block_ids.append(block_id)
            self._holders.setdefault(block_id, set()).add(seq_id)

    def _check_feed(
        self, step_id: int, seq_id: int, sequence: _Sequence, start: int, num: int
    ) -> None:
        if start != sequence.num_positions:
            raise PlanError(
                f"step {step_id}: seq {seq_id} feeds from position {start} but has K/V "
                f"up to {sequence.num_positions}"
            )
        end = start + num
        if end > self.geometry.max_context_tokens:
            raise PlanError(f"seq {seq_id} feeds up to position {end - 1}, beyond the context")
        if end > len(sequence.block_ids) * self.geometry.block_size:
            raise PlanError(
                f"step {step_id}: seq {seq_id}'s {len(sequence.block_ids)} blocks do not "
                f"cover position {end - 1}"
            )

    def _check_cached(self, seq_id: int, sequence: _Sequence, cached_token_ids: list[int]) -> None:
        """The prefix blocks a new sequence points at hold exactly its cached tokens' K/V."""
        block_size = self.geometry.block_size
        prefix_hash = 0
        for position, token_id in enumerate(cached_token_ids):
            prefix_hash = hash((prefix_hash, token_id))
            slot = (sequence.block_ids[position // block_size], position % block_size)
            unwritten = slot[0] in self._unwritten or slot[0] in self._unwritten_before
            if unwritten and self._slots.get(slot) != prefix_hash:
                sequence.garbage = True  # a writer of this step (or the one before) was refused
                sequence.garbage_step = self.num_steps
                return
            if self._slots.get(slot) != prefix_hash:
                raise PlanError(f"seq {seq_id}'s cached position {position} holds other K/V")
        sequence.prefix_hash = prefix_hash

    def _write(
        self, seq_id: int, sequence: _Sequence, start: int, fed: list[int], forgetting: set[int]
    ) -> None:
        block_size = self.geometry.block_size
        prefix_hash = sequence.prefix_hash
        for offset, token_id in enumerate(fed):
            position = start + offset
            prefix_hash = hash((prefix_hash, token_id))
            block_id = sequence.block_ids[position // block_size]
            slot = (block_id, position % block_size)
            old = self._slots.get(slot)
            if old is not None and old != prefix_hash:
                for other_id in self._holders[block_id] - forgetting:
                    other = self._sequences[other_id]
                    other_position = other.block_index[block_id] * block_size + slot[1]
                    if other_id != seq_id and other_position < other.num_positions:
                        raise PlanError(
                            f"seq {seq_id} overwrites block {block_id} slot {slot[1]} that "
                            f"seq {other_id} still reads"
                        )
            self._slots[slot] = prefix_hash
        sequence.prefix_hash = prefix_hash

    @staticmethod
    def _fill_logprobs(result: StepResult, sampled: list[_Sequence]) -> None:
        result.top_offsets.append(0)
        for token_id, sequence in zip(result.token_ids, sampled, strict=True):
            result.logprobs.append(-0.5)
            top = [token_id, *range(sequence.num_logprobs - 1)][: sequence.num_logprobs]
            result.top_token_ids.extend(top)
            result.top_logprobs.extend(-0.5 - rank for rank in range(len(top)))
            result.top_offsets.append(len(result.top_token_ids))
