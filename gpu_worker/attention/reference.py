"""The reference paged-attention backend: gather + SDPA in plain torch (the CPU default).

Decode rows attend in padded SDPA calls over their blocks gathered from the cache, one
call per group of rows of similar context length (DecodeGroup); each prefill chunk attends causally over its own keys: this step's K/V when it starts
at position 0, otherwise every earlier slot gathered through its block table. Its
results define what every other backend must compute (tests compare against it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.gpu_worker.attention.backend import AttentionMetadata
from pagoda.gpu_worker.attention.invariant import attend_batch_invariant


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    is_causal: bool = False,
) -> torch.Tensor:
    """softmax(q k^T * scale [+ mask]) v with [..., heads, len, dim] inputs (mask: True = attend).

    q may have a multiple of k's heads (grouped-query attention). On the CPU, the
    batch-invariant formulation (attention/invariant.py); on CUDA, SDPA.
    """
    if query.device.type == "cpu":
        return attend_batch_invariant(query, key, value, mask, scale, softcap, is_causal)
    if softcap is None:
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            is_causal=is_causal and mask is None,
            scale=scale,
            enable_gqa=query.shape[-3] != key.shape[-3],
        )
    # Logit soft-capping (Gemma 2) has no SDPA kernel: the plain math path.
    group = query.shape[-3] // key.shape[-3]
    if group > 1:
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scores = (query @ key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal and mask is None:
        q_len, k_len = scores.shape[-2:]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(value.dtype) @ value


# Decode rows are padded to the longest key count of their SDPA call, and on a CPU the
# padded keys cost as much as real ones (gathered, then read): 9 rows at 553 keys beside 27
# at 40 took 474 ms padded against 72 ms in two calls (30 layers, 1 thread). So rows are
# grouped by length: each row is at least half as long (in blocks) as its group's longest,
# so padding at most doubles a row's keys. Each extra call costs tens of microseconds a
# layer, so rows stay in one call unless grouping saves at least this many key rows.
MIN_SAVED_KEY_ROWS = 2048


def decode_groups(context_lens: list[int], block_size: int) -> list[list[int]] | None:
    """The decode rows' groups (row indices, longest first), or None for one call."""
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__, reverse=True)
    groups: list[list[int]] = []
    longest_blocks = 0
    for row in order:
        num_blocks = -(-context_lens[row] // block_size)
        if groups and 2 * num_blocks > longest_blocks:
            groups[-1].append(row)
        else:
            groups.append([row])
            longest_blocks = num_blocks
    if len(groups) == 1:
        return None
    padded = len(context_lens) * context_lens[order[0]]
    grouped = sum(len(group) * context_lens[group[0]] for group in groups)
    return groups if padded - grouped >= MIN_SAVED_KEY_ROWS else None


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows attended in one call: their blocks, gathered whole, padded to num_keys."""

    rows: torch.Tensor | None  # indices among the decode rows; None: all, in order
    block_ids: torch.Tensor
    num_keys: int
    context_lens: torch.Tensor  # [rows] on the device, for the padding mask
    all_full: bool  # every row sees all num_keys keys


class _StepCache:
    """What the reference derives once per step from the metadata and every layer reuses."""

    __slots__ = ("metadata", "decode", "masks", "prefill")

    def __init__(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        self.decode: list[DecodeGroup] = []
        self.masks: dict = {}  # (kind, index, window) -> mask or None
        # Per prefill sequence: (row start, row end, start position, key slots or None).
        self.prefill: list[tuple[int, int, int, torch.Tensor | None]] = []
        num_decode = metadata.num_decode_seqs
        block_size = metadata.block_size
        context_lens = metadata.context_lens_cpu.tolist()
        if num_decode:
            self.decode = self._decode_groups(context_lens[:num_decode])
        starts = metadata.query_start_loc_cpu.tolist()
        offsets = None
        for seq in range(num_decode, metadata.num_seqs):
            row_start, row_end = starts[seq], starts[seq + 1]
            end_position = context_lens[seq]
            start_position = end_position - (row_end - row_start)
            key_slots = None
            if start_position > 0:  # continues earlier tokens: gather every slot so far
                if offsets is None:
                    offsets = torch.arange(block_size, device=metadata.block_table.device)
                num_blocks = -(-end_position // block_size)
                blocks = metadata.block_table[seq, :num_blocks].long()
                key_slots = (blocks[:, None] * block_size + offsets).reshape(-1)[:end_position]
            self.prefill.append((row_start, row_end, start_position, key_slots))

    def _decode_groups(self, lens: list[int]) -> list[DecodeGroup]:
        groups = decode_groups(lens, self.metadata.block_size)
        if groups is None:
            return [self._group(None, max(lens), min(lens))]
        device = self.metadata.block_table.device
        return [
            self._group(torch.tensor(rows, device=device), lens[rows[0]], lens[rows[-1]])
            for rows in groups
        ]

    def _group(self, rows: torch.Tensor | None, longest: int, shortest: int) -> DecodeGroup:
        """The group of decode `rows` (None: all, in order) whose contexts span
        shortest..longest keys."""
        metadata = self.metadata
        table, lens = metadata.block_table, metadata.context_lens
        if rows is None:
            num_decode = metadata.num_decode_seqs
            table, lens = table[:num_decode], lens[:num_decode]
        else:
            table, lens = table.index_select(0, rows), lens.index_select(0, rows)
        num_blocks = -(-longest // metadata.block_size)
        block_ids = table[:, :num_blocks].reshape(-1)
        return DecodeGroup(rows, block_ids, longest, lens, shortest == longest)

    def decode_mask(self, index: int, sliding_window: int | None) -> torch.Tensor | None:
        """[B, 1, 1, L] bool (True: attend) of decode group `index`, or None when every row
        sees all L keys."""
        key = ("decode", index, sliding_window)
        if key not in self.masks:
            group = self.decode[index]
            num_keys = group.num_keys
            windowed = sliding_window is not None and sliding_window < num_keys
            if not windowed and group.all_full:
                self.masks[key] = None
            else:
                lens = group.context_lens
                key_positions = torch.arange(num_keys, device=lens.device)[None, :]
                mask = key_positions < lens[:, None]
                if sliding_window is not None:
                    # Query at position p = len - 1 sees keys p - window < j <= p.
                    mask &= key_positions > (lens[:, None] - 1 - sliding_window)
                self.masks[key] = mask[:, None, None, :]
        return self.masks[key]

    def prefill_mask(self, index: int, sliding_window: int | None) -> torch.Tensor | None:
        """[n, end_position] bool causal mask of prefill sequence `index`; None: plain causal."""
        key = ("prefill", index, sliding_window)
        if key not in self.masks:
            row_start, row_end, start_position, _ = self.prefill[index]
            num_tokens = row_end - row_start
            if start_position == 0 and (sliding_window is None or sliding_window >= num_tokens):
                self.masks[key] = None
            else:
                device = self.metadata.block_table.device
                end_position = start_position + num_tokens
                query_positions = torch.arange(start_position, end_position, device=device)[:, None]
                key_positions = torch.arange(end_position, device=device)[None, :]
                mask = key_positions <= query_positions
                if sliding_window is not None:
                    mask &= key_positions > query_positions - sliding_window
                self.masks[key] = mask
        return self.masks[key]


class ReferenceBackend:
    """Gather + SDPA; see the module docstring. Keeps one step's derived tensors."""

    name = "reference"

    def __init__(self) -> None:
        self._step: _StepCache | None = None

    def _step_cache(self, metadata: AttentionMetadata) -> _StepCache:
        step = self._step
        if step is None or step.metadata is not metadata:
            step = self._step = _StepCache(metadata)
        return step

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        flat = (-1, *key_cache.shape[2:])
        key_cache.view(flat).index_copy_(0, metadata.slot_mapping, key.to(key_cache.dtype))
        value_cache.view(flat).index_copy_(0, metadata.slot_mapping, value.to(value_cache.dtype))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        step = self._step_cache(metadata)
        num_decode = metadata.num_decode_seqs
        decode_args = (key_cache, value_cache, step, scale, sliding_window, softcap)
        if num_decode == metadata.num_tokens:  # decode only: no copy into an output buffer
            return self._decode(query, *decode_args)
        output = query.new_empty(query.shape)
        if num_decode:
            output[:num_decode] = self._decode(query[:num_decode], *decode_args)
        flat = (-1, *key_cache.shape[2:])
        key_slots_all, value_slots_all = key_cache.view(flat), value_cache.view(flat)
        queries = query.transpose(0, 1)  # [heads, T, d]
        for index, (row_start, row_end, _, key_slots) in enumerate(step.prefill):
            if key_slots is None:  # starts at position 0: its keys are exactly this step's
                span_keys = key[row_start:row_end].transpose(0, 1)
                span_values = value[row_start:row_end].transpose(0, 1)
            else:
                span_keys = key_slots_all.index_select(0, key_slots).transpose(0, 1)
                span_values = value_slots_all.index_select(0, key_slots).transpose(0, 1)
            mask = step.prefill_mask(index, sliding_window)
            attended = attend(
                queries[None, :, row_start:row_end],
                span_keys[None].to(query.dtype),
                span_values[None].to(query.dtype),
                mask,
                scale,
                softcap,
                is_causal=mask is None,
            )
            output[row_start:row_end] = attended[0].transpose(0, 1)
        return output

    @classmethod
    def _decode(
        cls,
        queries: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        step: _StepCache,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """The one-token rows, queries [B, heads, d] -> [B, heads, d], a call per group."""
        args = (key_cache, value_cache, step, scale, sliding_window, softcap)
        if len(step.decode) == 1:
            return cls._decode_group(queries, 0, *args)
        output = queries.new_empty(queries.shape)
        for index, group in enumerate(step.decode):
            rows = group.rows
            output.index_copy_(
                0, rows, cls._decode_group(queries.index_select(0, rows), index, *args)
            )
        return output

    @staticmethod
    def _decode_group(
        queries: torch.Tensor,
        index: int,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        step: _StepCache,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """The rows of decode group `index` at once: queries [B, heads, d] -> [B, heads, d].

        Keys are gathered by whole blocks (index_select of blocks: several times faster
        than advanced indexing on CPU), then seen as [B, kv_heads, L, d] with a padding
        mask where a row has fewer than L keys. With grouped-query attention the `group`
        query heads sharing a KV head become that head's `group` query rows, so no K/V is
        repeated. Few torch calls: at batch 1-8 on a CPU their fixed costs are the step's
        overhead over a plain forward.
        """
        num_rows, num_heads, head_dim = queries.shape
        num_kv_heads = key_cache.shape[2]
        group = step.decode[index]
        num_keys, block_ids = group.num_keys, group.block_ids
        gathered_shape = (num_rows, -1, num_kv_heads, head_dim)
        keys = key_cache.index_select(0, block_ids).view(gathered_shape)
        values = value_cache.index_select(0, block_ids).view(gathered_shape)
        if keys.shape[1] != num_keys:
            keys, values = keys[:, :num_keys], values[:, :num_keys]
        if keys.dtype != queries.dtype:
            keys, values = keys.to(queries.dtype), values.to(queries.dtype)
        # [B, heads, d] -> [B, kv_heads, group, d]: a view (splitting one dimension).
        grouped = queries.view(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
        mask = step.decode_mask(index, sliding_window)  # [B, 1, 1, L]: over heads and group
        attended = attend(
            grouped, keys.transpose(1, 2), values.transpose(1, 2), mask, scale, softcap
        )
        # reshape, not view: CUDA's SDPA kernels may return [B, kv_heads, group, d] in
        # another memory order (seen on an H200), which no view can regroup.
        return attended.reshape(num_rows, num_heads, head_dim)
