"""Penalty counts kept on the device from each step's fed tokens (issue 16 item 4) equal
the counts rebuilt from whole histories, through prefix hits, chunked prefill, rewinds,
forgets and reused ids; and an engine sampling with them gives the tokens the history
path gives."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda.common.step import NewSequence, SamplingParams, StepPlan
from pagoda.gpu_worker.sampler import SampleRow, counts_from_histories
from pagoda.gpu_worker.sequence_table import SequenceTable
from pagoda.gpu_worker.token_counts import TokenCounts
from pagoda.protos import step_pb2
from tests.worker.conftest import TEST_BLOCK_SIZE, TEST_NUM_BLOCKS
from tests.worker.toy_scheduler import ToyScheduler, split_into

VOCAB = 64
REPEAT = SamplingParams(repetition_penalty=1.3)
FREQUENT = SamplingParams(frequency_penalty=0.5, presence_penalty=0.2)


class Steps:
    """Hand-built plans over a SequenceTable; each admitted step updates the counts."""

    def __init__(self) -> None:
        self.table = SequenceTable(
            num_kv_blocks=256, block_size=4, vocab_size=VOCAB, max_context_tokens=128,
            max_logprobs=0,
        )  # fmt: skip
        self.counts = TokenCounts(VOCAB, torch.device("cpu"), initial_rows=2)  # grows
        self.next_block = 0
        self.step_id = 0

    def run(self, entries, new=(), forget=()) -> None:
        """entries: (seq_id, start_position, tokens); every entry samples."""
        plan = StepPlan(step_id=self.step_id, new_sequences=list(new), token_offsets=[0],
                        block_offsets=[0], forget_seq_ids=list(forget))  # fmt: skip
        for seq_id, start, tokens in entries:
            plan.seq_ids.append(seq_id)
            plan.start_positions.append(start)
            plan.sample.append(True)
            plan.token_ids.extend(tokens)
            plan.token_offsets.append(len(plan.token_ids))
            plan.block_ids.extend(range(self.next_block, self.next_block + 3))  # ample
            self.next_block += 3
            plan.block_offsets.append(len(plan.block_ids))
        admitted, refusals = self.table.admit(plan)
        assert not refusals
        self.counts.update(admitted, self.table)
        self.check(admitted)
        self.table.forget(admitted.forget_seq_ids)
        self.step_id += 1

    def check(self, plan) -> None:
        sequences = self.table.sequences_of(plan.seq_ids)
        ends = [plan.start_positions[i] + plan.token_offsets[i + 1] - plan.token_offsets[i]
                for i in range(len(sequences))]  # fmt: skip
        rows = [
            SampleRow(seq.sampling, seq.token_ids[:end], seq.num_prompt_tokens, end)
            for seq, end in zip(sequences, ends, strict=True)
        ]
        seen, generated = self.counts.gather([self.counts.row_of(seq) for seq in sequences])
        want_seen, want_generated = counts_from_histories(rows, VOCAB, "cpu")
        for i, seq in enumerate(sequences):
            if seq.sampling in (REPEAT, FREQUENT):
                assert torch.equal(seen[i], want_seen[i]), seq.seq_id
                assert torch.equal(generated[i], want_generated[i]), seq.seq_id
            else:  # no penalty, no row: the zero row
                assert not seen[i].any() and not generated[i].any()


def test_device_counts_follow_every_kind_of_step():
    steps = Steps()
    steps.run(
        [(1, 2, [5, 6, 5, 7]), (2, 0, [9, 9, 9]), (3, 0, [4, 4, 8])],
        new=[
            NewSequence(1, REPEAT, num_prompt_tokens=6, cached_token_ids=[3, 5]),  # prefix hit
            NewSequence(2, SamplingParams(), num_prompt_tokens=3),  # no penalty: no row
            NewSequence(3, FREQUENT, num_prompt_tokens=3),
        ],
    )
    steps.run([(1, 6, [11]), (3, 3, [4])])  # generated tokens, one a prompt id
    steps.run([(1, 7, [11]), (3, 4, [4]), (2, 3, [1])])
    steps.run([(1, 4, [12, 12, 13])])  # rewound into its prompt (recompute): counted again
    steps.run([(3, 5, [8])], forget=[1])
    # Id 1 reused by a new sequence (after its forget): a fresh row, nothing inherited;
    # a third penalized sequence makes the table grow past its initial two rows.
    steps.run(
        [(1, 0, [20, 21]), (4, 0, [30, 30]), (3, 6, [4])],
        new=[
            NewSequence(1, FREQUENT, num_prompt_tokens=1),
            NewSequence(4, REPEAT, num_prompt_tokens=2),
        ],
    )
    assert steps.counts.num_rows_in_use == 3
    steps.run([(1, 2, [21]), (4, 2, [31])], forget=[3])
    steps.run([(4, 3, [30])])
    assert steps.counts.num_rows_in_use == 2  # 3's row reclaimed


def _penalized(seed: int) -> step_pb2.SamplingParams:
    return step_pb2.SamplingParams(
        temperature=0.0, top_p=1.0, repetition_penalty=1.5, frequency_penalty=0.4,
        presence_penalty=0.3, seed=seed,
    )  # fmt: skip


def _run(engine, prompts, recompute: bool) -> dict[int, list[int]]:
    rng = random.Random(1)
    scheduler = ToyScheduler(engine, num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE)
    for seq_id, prompt in enumerate(prompts):
        sampling = _penalized(seq_id) if seq_id % 3 else None  # some rows greedy, no penalty
        chunks = split_into(len(prompt), 2, rng)
        scheduler.add(seq_id, prompt, sampling=sampling, chunk_sizes=chunks, admit_at_step=seq_id)
    scheduler.run(6)
    if recompute:
        scheduler.recompute(1, 10)  # forgets 1, re-registers its prompt + generated as 10
    return scheduler.run(14)


@pytest.mark.parametrize("recompute", [False, True])
def test_engine_tokens_with_device_counts_equal_the_history_path(
    llama_models, monkeypatch, recompute
):
    from pagoda.gpu_worker import paged_engine

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 9, 12)]
    device_counts = _run(llama_models.engine(), prompts, recompute)
    # has_penalty False in the engine: no device counts, the sampler counts the histories.
    monkeypatch.setattr(paged_engine, "has_penalty", lambda params: False)
    history_counts = _run(llama_models.engine(), prompts, recompute)
    assert device_counts == history_counts
    monkeypatch.undo()
    plain = _run_plain(llama_models, prompts)
    assert device_counts != plain  # the penalties change the tokens: the test can fail


def _run_plain(llama_models, prompts) -> dict[int, list[int]]:
    scheduler = ToyScheduler(
        llama_models.engine(), num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE
    )
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, prompt, admit_at_step=seq_id)
    return scheduler.run(20)


def test_a_burst_of_new_penalized_sequences_grows_the_tables_once(monkeypatch):
    """Nine new penalized sequences in one step from a table with one free row: the tables
    grow once, to 16 rows (not 4, 8, then 16), and every row's counts are its own."""
    steps = Steps()
    tables_made = []
    real_zeros = torch.zeros

    def counting_zeros(*shape, **kwargs):
        if shape[1:] == (VOCAB,):
            tables_made.append(shape[0])
        return real_zeros(*shape, **kwargs)

    real_update = steps.counts.update

    def update(*args):
        monkeypatch.setattr(torch, "zeros", counting_zeros)
        try:
            real_update(*args)
        finally:
            monkeypatch.setattr(torch, "zeros", real_zeros)

    steps.counts.update = update
    steps.run(
        [(seq_id, 0, [seq_id + 3, seq_id + 3, 40]) for seq_id in range(9)],
        new=[
            NewSequence(seq_id, REPEAT if seq_id % 2 else FREQUENT, num_prompt_tokens=2)
            for seq_id in range(9)
        ],
    )  # Steps.run checks every row against its history
    assert tables_made == [16, 16]  # seen and output counts, once each
    assert steps.counts.num_rows_in_use == 9
    steps.run([(seq_id, 3, [seq_id + 3]) for seq_id in range(9)])
