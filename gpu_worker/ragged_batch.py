"""One step's tokens packed as a single [1, T] sequence, plus what attention needs to
find each sequence's keys in the paged pool.

Packing order: single-token (decode) chunks first, then multi-token (prefill) chunks,
so decode queries are the contiguous rows [0, num_decode_tokens) and every layer
answers all of them with one padded SDPA call. Built once per step; every layer
reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from pagoda.gpu_worker.sequence_table import ScheduledChunk


@dataclass(slots=True)
class PrefillSpan:
    """A multi-token chunk: packed rows [query_start, query_end) at positions from start_position."""

    query_start: int
    query_end: int
    start_position: int
    # Pool slot of every position [0, end_position) when the chunk continues earlier
    # tokens; None when it starts at 0 (its keys are exactly this step's keys).
    key_slots: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return self.query_end - self.query_start

    @property
    def end_position(self) -> int:
        return self.start_position + self.num_tokens


@dataclass(slots=True)
class RaggedBatch:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    slot_mapping: torch.Tensor  # [T]: pool slot each fed token's K/V is written to
    num_decode_tokens: int  # B: rows [0, B) are single-token chunks, one per sequence
    # [B * N]: the first N blocks of each decode row's table, N = ceil(L / block_size) for
    # L the longest decode context (shorter tables padded with block 0, masked); flat for
    # one index_select of whole blocks per layer.
    decode_block_ids: torch.Tensor | None
    decode_context_lens: torch.Tensor | None  # [B]: keys each decode row attends to
    decode_num_keys: int  # L
    decode_needs_padding_mask: bool  # False: every decode row sees all L keys
    block_size: int
    prefill_spans: list[PrefillSpan]
    sample_token_indices: torch.Tensor  # [S]: packed row of each sampling chunk, plan order
    sample_chunks: list[ScheduledChunk]  # the S sampling chunks, plan order
    _masks: dict = field(default_factory=dict)  # (kind, index, window) -> mask

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor | None:
        """[B, 1, 1, L] bool (True: attend), or None when no row needs masking."""
        key = ("decode", 0, sliding_window)
        if key not in self._masks:
            lens = self.decode_context_lens
            num_keys = self.decode_num_keys
            key_positions = torch.arange(num_keys, device=lens.device)[None, :]
            mask = key_positions < lens[:, None]
            if sliding_window is not None:
                # HF semantics: query at position p sees keys p - window < j <= p.
                mask &= key_positions > (lens[:, None] - 1 - sliding_window)
            windowed = sliding_window is not None and sliding_window < num_keys
            needed = self.decode_needs_padding_mask or windowed
            self._masks[key] = mask[:, None, None, :] if needed else None
        return self._masks[key]

    def prefill_mask(self, index: int, sliding_window: int | None) -> torch.Tensor | None:
        """[n, end_position] bool causal mask of prefill span `index`; None: plain causal."""
        span = self.prefill_spans[index]
        key = ("prefill", index, sliding_window)
        if key not in self._masks:
            if span.start_position == 0 and (
                sliding_window is None or sliding_window >= span.num_tokens
            ):
                self._masks[key] = None
            else:
                device = self.input_ids.device
                query_positions = torch.arange(
                    span.start_position, span.end_position, device=device
                )[:, None]
                key_positions = torch.arange(span.end_position, device=device)[None, :]
                mask = key_positions <= query_positions
                if sliding_window is not None:
                    mask &= key_positions > query_positions - sliding_window
                self._masks[key] = mask
        return self._masks[key]


def _slots_of_positions(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _key_slots(block_table: torch.Tensor, num_keys: int, block_size: int) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_keys] slots of positions 0..num_keys-1."""
    offsets = torch.arange(block_size, device=block_table.device)
    slots = block_table[..., :, None] * block_size + offsets
    return slots.flatten(-2)[..., :num_keys]


def build_ragged_batch(
    chunks: list[ScheduledChunk], block_size: int, device: torch.device
) -> RaggedBatch:
    """Pack `chunks` (validated: their block tables cover every fed position)."""
    decode = [c for c in chunks if c.num_tokens == 1]
    prefill = [c for c in chunks if c.num_tokens > 1]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    packed_end: dict[int, int] = {}  # id(chunk) -> packed row of its last token
    for chunk in decode + prefill:
        input_ids.extend(chunk.token_ids)
        positions.extend(range(chunk.start_position, chunk.end_position))
        slots.extend(
            _slots_of_positions(
                chunk.seq.block_ids, chunk.start_position, chunk.end_position, block_size
            )
        )
        packed_end[id(chunk)] = len(input_ids) - 1

    def as_tensor(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    decode_block_ids = decode_context_lens = None
    decode_num_keys = 0
    decode_needs_padding_mask = False
    if decode:
        context_lens = [c.end_position for c in decode]
        decode_num_keys = max(context_lens)
        num_table_blocks = -(-decode_num_keys // block_size)
        table = [
            c.seq.block_ids[:num_table_blocks] + [0] * (num_table_blocks - len(c.seq.block_ids))
            for c in decode
        ]
        decode_block_ids = as_tensor([block_id for row in table for block_id in row])
        decode_context_lens = as_tensor(context_lens)
        decode_needs_padding_mask = min(context_lens) != decode_num_keys

    spans = []
    row = len(decode)
    for chunk in prefill:
        key_slots = None
        if chunk.start_position > 0:
            num_blocks = -(-chunk.end_position // block_size)
            key_slots = _key_slots(
                as_tensor(chunk.seq.block_ids[:num_blocks]), chunk.end_position, block_size
            )
        spans.append(PrefillSpan(row, row + chunk.num_tokens, chunk.start_position, key_slots))
        row += chunk.num_tokens

    sample_chunks = [c for c in chunks if c.sample]
    return RaggedBatch(
        input_ids=as_tensor(input_ids)[None, :],
        position_ids=as_tensor(positions)[None, :],
        slot_mapping=as_tensor(slots),
        num_decode_tokens=len(decode),
        decode_block_ids=decode_block_ids,
        decode_context_lens=decode_context_lens,
        decode_num_keys=decode_num_keys,
        decode_needs_padding_mask=decode_needs_padding_mask,
        block_size=block_size,
        prefill_spans=spans,
        sample_token_indices=as_tensor([packed_end[id(c)] for c in sample_chunks]),
        sample_chunks=sample_chunks,
    )
