"""A toy scheduler for worker tests: hand-built column-wise StepPlans over a toy allocator.

Each job is "known tokens" (prompt + generated) of which the first `num_computed`
have KV in the job's blocks; every step feeds the next chunk of the rest and
samples when the chunk reaches the end. Prefill, chunked prefill, prefix sharing,
recompute and decode are all that one rule, as in the real scheduler.

A job with a `drafter` also feeds, after a chunk that reaches the end, the drafts it
returns (StepPlan.draft_counts) and keeps the samples as the real scheduler does: those
equal to the drafts, then one more; its next row starts after the drafts it kept.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from pagoda.protos import step_pb2
from tests.worker.conftest import run_plan


@dataclass
class Job:
    seq_id: int
    prompt: list[int]
    sampling: step_pb2.SamplingParams
    chunk_sizes: list[int]  # prompt chunk sizes still to use (then: the rest at once)
    admit_at_step: int = 0
    generated: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_blocks_sent: int = 0
    is_new: bool = True
    cached_token_ids: list[int] = field(default_factory=list)
    min_new_tokens: int = 0  # NewSequence's: the banned ids are masked until then
    min_tokens_banned_ids: list[int] = field(default_factory=list)
    # Drafts to feed after the known tokens in a row of it that samples ([]: none).
    drafter: Callable[[Job], list[int]] | None = None
    # Where each generated token came from: (step, entry of that step's result).
    entries: list[tuple[int, int]] = field(default_factory=list)
    num_drafts_fed: int = 0
    num_drafts_kept: int = 0

    @property
    def known(self) -> list[int]:
        return self.prompt + self.generated


def greedy() -> step_pb2.SamplingParams:
    return step_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)


def split_into(num_tokens: int, num_pieces: int, rng: random.Random) -> list[int]:
    """Random positive sizes summing to num_tokens (fewer pieces when too short)."""
    num_pieces = max(1, min(num_pieces, num_tokens))
    cuts = sorted(rng.sample(range(1, num_tokens), num_pieces - 1)) if num_pieces > 1 else []
    bounds = [0, *cuts, num_tokens]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


class ToyScheduler:
    def __init__(self, engine, *, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.engine = engine
        self.block_size = block_size
        rng = random.Random(seed)
        # Shuffled, so a block table is never a run of consecutive ids by accident.
        self.free_blocks = list(range(num_blocks))
        rng.shuffle(self.free_blocks)
        self.jobs: dict[int, Job] = {}  # by current seq id
        self.step_id = 0
        self.results: list[step_pb2.StepResult] = []
        self._forget: list[int] = []

    def add(
        self,
        seq_id: int,
        prompt: list[int],
        *,
        sampling: step_pb2.SamplingParams | None = None,
        chunk_sizes: list[int] | None = None,
        admit_at_step: int = 0,
        min_new_tokens: int = 0,
        min_tokens_banned_ids: list[int] | None = None,
    ) -> Job:
        job = Job(
            seq_id, list(prompt), sampling or greedy(), list(chunk_sizes or []), admit_at_step
        )
        job.min_new_tokens = min_new_tokens
        job.min_tokens_banned_ids = list(min_tokens_banned_ids or [])
        self.jobs[seq_id] = job
        return job

    def share_prefix(self, job: Job, source: Job, num_blocks: int) -> None:
        """`job` starts with `source`'s first full blocks (a prefix-cache hit)."""
        num_tokens = num_blocks * self.block_size
        assert job.prompt[:num_tokens] == source.prompt[:num_tokens]
        job.block_ids = source.block_ids[:num_blocks]
        job.num_computed = num_tokens
        job.cached_token_ids = job.prompt[:num_tokens]

    def allocate_prompt_blocks(self, job: Job) -> None:
        """Give `job` every block its prompt needs now (so a sharer can point at them)."""
        self._cover(job, len(job.prompt))

    def recompute(self, seq_id: int, new_seq_id: int) -> Job:
        """Preempt: forget the sequence, re-register it as `new_seq_id` from scratch."""
        job = self.jobs.pop(seq_id)
        self._forget.append(seq_id)
        job.seq_id = new_seq_id
        job.num_computed = 0
        job.block_ids = []
        job.num_blocks_sent = 0
        job.is_new = True
        job.cached_token_ids = []
        self.jobs[new_seq_id] = job
        return job

    def _cover(self, job: Job, num_positions: int) -> None:
        while len(job.block_ids) * self.block_size < num_positions:
            job.block_ids.append(self.free_blocks.pop())

    def step(self, is_done: Callable[[Job], bool]) -> step_pb2.StepResult:
        plan = step_pb2.StepPlan(step_id=self.step_id)
        plan.forget_seq_ids.extend(self._forget)
        self._forget = []
        fed: dict[int, int] = {}
        drafted: dict[int, list[int]] = {}
        draft_counts: list[int] = []
        offsets_started = False
        for job in self.jobs.values():
            if job.admit_at_step > self.step_id or is_done(job):
                continue
            known = job.known
            chunk = job.chunk_sizes.pop(0) if job.chunk_sizes else len(known) - job.num_computed
            chunk = min(chunk, len(known) - job.num_computed)
            end = job.num_computed + chunk
            drafts = job.drafter(job) if job.drafter is not None and end == len(known) else []
            self._cover(job, end + len(drafts))
            if job.is_new:
                plan.new_sequences.add(
                    seq_id=job.seq_id,
                    sampling=job.sampling,
                    cached_token_ids=job.cached_token_ids,
                    num_prompt_tokens=len(job.prompt),
                    min_new_tokens=job.min_new_tokens,
                    min_tokens_banned_ids=job.min_tokens_banned_ids,
                )
                job.is_new = False
            if not offsets_started:
                plan.token_offsets.append(0)
                plan.block_offsets.append(0)
                offsets_started = True
            plan.seq_ids.append(job.seq_id)
            plan.start_positions.append(job.num_computed)
            plan.sample.append(end == len(known))
            plan.token_ids.extend(known[job.num_computed : end] + drafts)
            plan.token_offsets.append(len(plan.token_ids))
            draft_counts.append(len(drafts))
            drafted[job.seq_id] = drafts
            plan.block_ids.extend(job.block_ids[job.num_blocks_sent :])
            plan.block_offsets.append(len(plan.block_ids))
            job.num_blocks_sent = len(job.block_ids)
            fed[job.seq_id] = chunk
        if any(draft_counts):
            plan.draft_counts.extend(draft_counts)
        result = run_plan(self.engine, plan)
        assert not result.step_error, result.step_error
        assert not result.errors, list(result.errors)
        samples: dict[int, list[int]] = {}  # seq id -> its entries of the result, in order
        for entry, seq_id in enumerate(result.seq_ids):
            samples.setdefault(seq_id, []).append(entry)
        for seq_id, entries in samples.items():
            job, drafts = self.jobs[seq_id], drafted[seq_id]
            assert len(entries) == len(drafts) + 1, "not one sample per draft, plus one"
            tokens = [result.token_ids[entry] for entry in entries]
            num_kept = next((k for k, d in enumerate(drafts) if tokens[k] != d), len(drafts))
            job.generated += tokens[: num_kept + 1]
            job.entries += [(self.step_id, entry) for entry in entries[: num_kept + 1]]
            job.num_drafts_fed += len(drafts)
            job.num_drafts_kept += num_kept
            fed[seq_id] += num_kept  # the kept drafts' K/V is the tokens'
        for seq_id, count in fed.items():
            self.jobs[seq_id].num_computed += count
        self.results.append(result)
        self.step_id += 1
        return result

    def run(self, num_new_tokens: int, max_steps: int = 500) -> dict[int, list[int]]:
        """Step until every job has generated num_new_tokens; tokens by current seq id."""

        def is_done(job: Job) -> bool:
            return len(job.generated) >= num_new_tokens

        while not all(is_done(job) for job in self.jobs.values()):
            assert self.step_id < max_steps, "toy scheduler made no progress"
            self.step(is_done)
        return {seq_id: job.generated for seq_id, job in self.jobs.items()}
