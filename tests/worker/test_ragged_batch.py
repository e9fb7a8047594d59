"""The ragged batch packed from an admitted plan's columns: decode rows first, then
prefill rows, each token's slot in its sequence's blocks, the sampled rows in plan order."""

from __future__ import annotations

import torch

from pagoda.common.step import NewSequence, SamplingParams, StepPlan
from pagoda.gpu_worker.ragged_batch import build_ragged_batch
from pagoda.gpu_worker.sequence_table import SequenceTable

BLOCK_SIZE = 4
CPU = torch.device("cpu")


def admitted_plan(table: SequenceTable, rows, step_id: int) -> StepPlan:
    """rows: (seq_id, start, tokens, new_block_ids, sample); new sequences for start 0."""
    plan = StepPlan(step_id=step_id, token_offsets=[0], block_offsets=[0])
    for seq_id, start, tokens, blocks, sample in rows:
        if start == 0:
            plan.new_sequences.append(NewSequence(seq_id, SamplingParams(), len(tokens)))
        plan.seq_ids.append(seq_id)
        plan.start_positions.append(start)
        plan.sample.append(sample)
        plan.token_ids.extend(tokens)
        plan.token_offsets.append(len(plan.token_ids))
        plan.block_ids.extend(blocks)
        plan.block_offsets.append(len(plan.block_ids))
    admitted, refusals = table.admit(plan)
    assert refusals == {}
    return admitted


def test_a_mixed_step_packs_decodes_first_and_maps_every_token_to_its_slot():
    table = SequenceTable(
        num_kv_blocks=64, block_size=BLOCK_SIZE, vocab_size=100, max_context_tokens=64,
        max_logprobs=0,
    )  # fmt: skip
    admitted_plan(table, [(1, 0, [1] * 5, [9, 3], True), (2, 0, [2] * 3, [7], True)], step_id=0)
    # Row 0: a fresh prompt of 6 tokens across blocks 20 and 5; row 1: a decode of 1 at
    # position 5; row 2: a prompt chunk of 2 across blocks 7 and 12 that does not sample.
    plan = admitted_plan(
        table,
        [
            (3, 0, [30, 31, 32, 33, 34, 35], [20, 5], True),
            (1, 5, [11], [], True),
            (2, 3, [21, 22], [12], False),
        ],
        step_id=1,
    )
    batch = build_ragged_batch(plan, table, BLOCK_SIZE, CPU)
    packed = [1, 0, 2]  # the decode row first, then the others in plan order
    want_ids, want_positions, want_slots, ends = [], [], [], {}
    for i in packed:
        seq = table.get(plan.seq_ids[i])
        start = plan.start_positions[i]
        tokens = plan.token_ids[plan.token_offsets[i] : plan.token_offsets[i + 1]]
        for position in range(start, start + len(tokens)):
            want_positions.append(position)
            want_slots.append(
                seq.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
            )
        want_ids.extend(tokens)
        ends[i] = len(want_ids) - 1
    assert batch.input_ids[0].tolist() == want_ids
    assert batch.position_ids[0].tolist() == want_positions
    assert batch.attention.slot_mapping.tolist() == want_slots
    assert want_slots == [3 * 4 + 1, 80, 81, 82, 83, 20, 21, 7 * 4 + 3, 12 * 4]
    assert batch.attention.query_start_loc.tolist() == [0, 1, 7, 9]
    assert batch.attention.context_lens.tolist() == [6, 6, 5]
    assert batch.attention.num_decode_seqs == 1
    assert batch.sample_token_indices.tolist() == [ends[0], ends[1]]  # plan order
    assert batch.attention.block_table.tolist() == [[9, 3], [20, 5], [7, 12]]


def test_an_all_decode_step_keeps_plan_order():
    table = SequenceTable(
        num_kv_blocks=64, block_size=BLOCK_SIZE, vocab_size=100, max_context_tokens=64,
        max_logprobs=0,
    )  # fmt: skip
    admitted_plan(table, [(1, 0, [1] * 4, [9, 3], True), (2, 0, [2] * 2, [7], True)], step_id=0)
    plan = admitted_plan(table, [(2, 2, [5], [], True), (1, 4, [6], [], True)], step_id=1)
    batch = build_ragged_batch(plan, table, BLOCK_SIZE, CPU)
    assert batch.input_ids[0].tolist() == [5, 6]
    assert batch.attention.slot_mapping.tolist() == [7 * 4 + 2, 3 * 4 + 0]
    assert batch.attention.context_lens.tolist() == [3, 5]
    assert batch.sample_token_indices.tolist() == [0, 1]
    assert batch.attention.num_decode_seqs == 2
