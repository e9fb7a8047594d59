"""One step's tokens packed as a single [1, T] sequence, plus the attention metadata
that lets every layer find each sequence's keys in the paged pool.

Packing order: single-token (decode) rows first, then multi-token (prefill) rows
(the order pagoda.gpu_worker.attention.backend defines). Logits are kept at the packed
token before each sample point (SequenceTable.sampling_rows): a row's last token, or a
row with d drafts' last d + 1 tokens (a row's tokens are packed together, in order).
Built once per step on the host from the admitted plan's columns, in two flat buffers
(int64 and int32) so that reaching the device costs two copies, from pinned memory on
CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.common.step import StepPlan
from pagoda.gpu_worker.attention.backend import AttentionMetadata
from pagoda.gpu_worker.sequence_table import SequenceTable, spread_drafts
from pagoda.gpu_worker.step_events import upload


@dataclass(slots=True)
class RaggedBatch:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    sample_token_indices: torch.Tensor  # [S]: packed row before each sample point, in order
    attention: AttentionMetadata

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def build_ragged_batch(
    plan: StepPlan,
    table: SequenceTable,
    block_size: int,
    device: torch.device,
    block_tables: tuple[torch.Tensor, dict[int, int]] | None = None,
) -> RaggedBatch:
    """Pack an admitted `plan` (SequenceTable.admit: every row's sequence is in `table`
    and its block table covers every fed position).

    block_tables: (the device table [rows, max_blocks], each sequence's row by seq_id) from
    pagoda.gpu_worker.block_tables, up to date: the step's table is gathered on the device
    from B row numbers. None: built from the sequences' lists on the host.
    """
    seq_ids = plan.seq_ids
    starts = plan.start_positions
    offsets = plan.token_offsets
    num_seqs = len(seq_ids)
    num_tokens = len(plan.token_ids)
    sequences = table.sequences_of(seq_ids)
    if num_tokens == num_seqs:  # every row feeds one token (an admitted row feeds some)
        num_decode = num_seqs
        order = None  # plan order
        input_ids = plan.token_ids
        positions = starts
        slots = [
            seq.block_ids[p // block_size] * block_size + p % block_size
            for seq, p in zip(sequences, starts, strict=True)
        ]
        query_start_loc = list(range(num_seqs + 1))
        context_lens = [p + 1 for p in starts]
        # No row has drafts: a row with d feeds more than d tokens (SequenceTable.admit).
        sample_rows = [i for i, sample in enumerate(plan.sample) if sample]
        max_query_len = 1
    else:
        decode = [i for i in range(num_seqs) if offsets[i + 1] - offsets[i] == 1]
        num_decode = len(decode)
        order = decode + [i for i in range(num_seqs) if offsets[i + 1] - offsets[i] > 1]
        token_ids = plan.token_ids
        input_ids = []
        positions = []
        slots = []
        query_start_loc = [0]
        context_lens = []
        packed_end = [0] * num_seqs  # plan row -> packed row of its last token
        for i in order:
            start = starts[i]
            end = start + offsets[i + 1] - offsets[i]
            input_ids.extend(token_ids[offsets[i] : offsets[i + 1]])
            block_ids = sequences[i].block_ids
            if end - start == 1:
                positions.append(start)
                slots.append(block_ids[start // block_size] * block_size + start % block_size)
            else:
                positions.extend(range(start, end))
                # One run of consecutive slots per block the row touches.
                for index in range(start // block_size, (end - 1) // block_size + 1):
                    first = index * block_size
                    base = block_ids[index] * block_size - first
                    slots.extend(
                        range(base + max(start, first), base + min(end, first + block_size))
                    )
            query_start_loc.append(len(input_ids))
            context_lens.append(end)
            packed_end[i] = len(input_ids) - 1
        rows = [i for i, sample in enumerate(plan.sample) if sample]
        sample_rows = [packed_end[i] for i in rows]
        if plan.draft_counts:
            sample_rows = spread_drafts(sample_rows, rows, plan.draft_counts)
        max_query_len = max(offsets[i + 1] - offsets[i] for i in range(num_seqs))
    max_context_len = max(context_lens)
    width = -(-max_context_len // block_size)
    if block_tables is None:
        table_ids: list[int] = []
        for i in range(num_seqs) if order is None else order:
            row = sequences[i].block_ids[:width]
            table_ids.extend(row)
            if len(row) < width:
                table_ids.extend([0] * (width - len(row)))
    else:
        device_table, rows_of = block_tables
        ordered_ids = seq_ids if order is None else [seq_ids[i] for i in order]
        table_ids = [rows_of[seq_id] for seq_id in ordered_ids]  # one row number each

    longs_host, longs = upload([*input_ids, *positions, *slots, *sample_rows], torch.long, device)
    ints_host, ints = upload([*query_start_loc, *context_lens, *table_ids], torch.int32, device)
    if block_tables is None:
        block_table = ints[2 * num_seqs + 1 :].view(num_seqs, width)
    else:
        # Only the columns this step's longest context uses.
        block_table = device_table[:, :width].index_select(0, ints[2 * num_seqs + 1 :])
    attention = AttentionMetadata(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_decode_seqs=num_decode,
        max_query_len=max_query_len,
        max_context_len=max_context_len,
        max_decode_context_len=max(context_lens[:num_decode], default=0),
        block_size=block_size,
        query_start_loc=ints[: num_seqs + 1],
        context_lens=ints[num_seqs + 1 : 2 * num_seqs + 1],
        block_table=block_table,
        slot_mapping=longs[2 * num_tokens : 3 * num_tokens],
        query_start_loc_cpu=ints_host[: num_seqs + 1],
        context_lens_cpu=ints_host[num_seqs + 1 : 2 * num_seqs + 1],
    )
    return RaggedBatch(
        input_ids=longs[:num_tokens][None, :],
        position_ids=longs[num_tokens : 2 * num_tokens][None, :],
        sample_token_indices=longs[3 * num_tokens :],
        attention=attention,
    )


def packed_rows(plan: StepPlan, rows: list[int]) -> list[int]:
    """The packed index of the token that each of `rows` (plan rows feeding one token
    each) feeds: one-token rows are packed first, in plan order."""
    offsets = plan.token_offsets
    if len(plan.token_ids) == len(plan.seq_ids):  # every row feeds one token: plan order
        return list(rows)
    rank: dict[int, int] = {}
    for i in range(len(plan.seq_ids)):
        if offsets[i + 1] - offsets[i] == 1:
            rank[i] = len(rank)
    return [rank[i] for i in rows]
