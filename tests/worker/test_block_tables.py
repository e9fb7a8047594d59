"""Block tables kept on the device from each plan's new blocks (issue 16 item 4): each
live sequence's row holds its block ids, through growth, forgets and reused ids, and a
step's metadata gathered from them equals the one built from the host lists."""

from __future__ import annotations

import torch

from pagoda.common.step import NewSequence, SamplingParams, StepPlan
from pagoda.gpu_worker.block_tables import BlockTables
from pagoda.gpu_worker.ragged_batch import build_ragged_batch
from pagoda.gpu_worker.sequence_table import SequenceTable

BLOCK_SIZE = 4
CPU = torch.device("cpu")


class Steps:
    def __init__(self) -> None:
        self.table = SequenceTable(
            num_kv_blocks=512, block_size=BLOCK_SIZE, vocab_size=64, max_context_tokens=64,
            max_logprobs=0,
        )  # fmt: skip
        self.tables = BlockTables(16, CPU, initial_rows=2)  # grows
        self.next_block = 100  # counting down: no table is a run of rising ids
        self.step_id = 0

    def run(self, entries, new=(), forget=()) -> None:
        """entries: (seq_id, start_position, num_tokens, num_new_blocks); every entry samples."""
        plan = StepPlan(step_id=self.step_id, new_sequences=list(new), token_offsets=[0],
                        block_offsets=[0], forget_seq_ids=list(forget))  # fmt: skip
        for seq_id, start, num_tokens, num_blocks in entries:
            plan.seq_ids.append(seq_id)
            plan.start_positions.append(start)
            plan.sample.append(True)
            plan.token_ids.extend([7] * num_tokens)
            plan.token_offsets.append(len(plan.token_ids))
            plan.block_ids.extend(range(self.next_block, self.next_block - num_blocks, -1))
            self.next_block -= num_blocks
            plan.block_offsets.append(len(plan.block_ids))
        admitted, refusals = self.table.admit(plan)
        assert not refusals, refusals
        rows_of = self.tables.update(admitted, self.table)
        for seq in self.table.sequences_of(admitted.seq_ids):
            ids = seq.block_ids
            assert self.tables.table[rows_of[seq.seq_id], : len(ids)].tolist() == ids
        host = build_ragged_batch(admitted, self.table, BLOCK_SIZE, CPU).attention
        device = build_ragged_batch(
            admitted, self.table, BLOCK_SIZE, CPU, (self.tables.table, rows_of)
        ).attention
        lens = host.context_lens.tolist()
        for i, context_len in enumerate(lens):  # the columns a backend may read
            num_blocks = -(-context_len // BLOCK_SIZE)
            assert device.block_table[i, :num_blocks].tolist() == (
                host.block_table[i, :num_blocks].tolist()
            )
        assert torch.equal(device.slot_mapping, host.slot_mapping)
        assert torch.equal(device.context_lens, host.context_lens)
        self.table.forget(admitted.forget_seq_ids)
        self.step_id += 1


def test_device_block_tables_follow_plans():
    steps = Steps()
    greedy = SamplingParams()
    steps.run(
        [(1, 0, 6, 2), (2, 0, 3, 1)],
        new=[NewSequence(1, greedy, num_prompt_tokens=6), NewSequence(2, greedy, 3)],
    )
    steps.run([(1, 6, 1, 0), (2, 3, 2, 1)])  # 2 crosses into a new block
    steps.run([(1, 7, 1, 0), (2, 5, 1, 0), (3, 0, 9, 3)], new=[NewSequence(3, greedy, 9)])
    assert steps.tables.num_rows_in_use == 3  # grew past 2 rows
    steps.run([(1, 8, 1, 1)], forget=[2])
    # Id 2 reused: a new sequence with other blocks in the reclaimed row.
    steps.run([(2, 0, 5, 2), (3, 9, 1, 0)], new=[NewSequence(2, greedy, 5)])
    steps.run([(2, 5, 1, 0), (1, 9, 1, 0)], forget=[3])
    steps.run([(1, 10, 1, 0)])
    assert steps.tables.num_rows_in_use == 2
