"""One step's tokens packed as a single [1, T] sequence, plus the attention metadata
that lets every layer find each sequence's keys in the paged pool.

Packing order: single-token (decode) chunks first, then multi-token (prefill) chunks
(the order pagoda.gpu_worker.attention.backend defines). Built once per step on the
host, in two flat buffers (int64 and int32) so that reaching the device costs two
copies, from pinned memory on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagoda.gpu_worker.attention.backend import AttentionMetadata
from pagoda.gpu_worker.sequence_table import ScheduledChunk


@dataclass(slots=True)
class RaggedBatch:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    sample_token_indices: torch.Tensor  # [S]: packed row of each sampling chunk, plan order
    sample_chunks: list[ScheduledChunk]  # the S sampling chunks, plan order
    attention: AttentionMetadata

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def _to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> tuple:
    """(host tensor, device tensor) of `values`; one copy, pinned and async on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host, host
    host = host.pin_memory()
    return host, host.to(device, non_blocking=True)


def build_ragged_batch(
    chunks: list[ScheduledChunk],
    block_size: int,
    device: torch.device,
    block_tables: tuple[torch.Tensor, dict[int, int]] | None = None,
) -> RaggedBatch:
    """Pack `chunks` (validated: their block tables cover every fed position).

    block_tables: (the device table [rows, max_blocks], each sequence's row by seq_id) from
    pagoda.gpu_worker.block_tables, up to date: the step's table is gathered on the device
    from B row numbers. None: built from the sequences' lists on the host.
    """
    decode = [c for c in chunks if len(c.token_ids) == 1]
    if len(decode) == len(chunks):
        ordered = chunks
    else:
        ordered = decode + [c for c in chunks if len(c.token_ids) > 1]
    num_seqs = len(ordered)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    context_lens: list[int] = []
    packed_end: dict[int, int] = {}  # id(chunk) -> packed row of its last token
    for chunk in ordered:
        start = chunk.start_position
        end = start + len(chunk.token_ids)
        input_ids.extend(chunk.token_ids)
        block_ids = chunk.seq.block_ids
        if end - start == 1:
            positions.append(start)
            slots.append(block_ids[start // block_size] * block_size + start % block_size)
        else:
            positions.extend(range(start, end))
            slots.extend(
                block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)
            )
        query_start_loc.append(len(input_ids))
        context_lens.append(end)
        packed_end[id(chunk)] = len(input_ids) - 1
    num_tokens = len(input_ids)
    max_context_len = max(context_lens)
    width = -(-max_context_len // block_size)
    if block_tables is None:
        table: list[int] = []
        for chunk in ordered:
            row = chunk.seq.block_ids[:width]
            table.extend(row)
            if len(row) < width:
                table.extend([0] * (width - len(row)))
    else:
        device_table, rows_of = block_tables
        table = [rows_of[chunk.seq.seq_id] for chunk in ordered]  # one row number each
    sample_chunks = [c for c in chunks if c.sample]
    sample_rows = [packed_end[id(c)] for c in sample_chunks]

    longs_host, longs = _to_device(input_ids + positions + slots + sample_rows, torch.long, device)
    ints_host, ints = _to_device(query_start_loc + context_lens + table, torch.int32, device)
    num_decode = len(decode)
    if block_tables is None:
        block_table = ints[2 * num_seqs + 1 :].view(num_seqs, width)
    else:
        # Only the columns this step's longest context uses.
        block_table = device_table[:, :width].index_select(0, ints[2 * num_seqs + 1 :])
    attention = AttentionMetadata(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_decode_seqs=num_decode,
        max_query_len=max(len(c.token_ids) for c in ordered),
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
        sample_chunks=sample_chunks,
        attention=attention,
    )
