"""The Triton paged-attention backend: one fused KV write and one attention launch per layer.

`write_kv` stores each row's key/value at its slot with one program per token (a slot
below zero is a padding row and is skipped, so a padded batch needs no host-side trim).

`paged_attention` runs decode rows and prefill chunks of any length in one launch. A
program owns one query tile of one sequence (BLOCK_Q consecutive rows) and one KV head.
Its BLOCK_M = BLOCK_Q * GROUP_PAD matrix rows are (token, query head of that KV head's
group) pairs, so the KV of a grouped-query head is read once for all its query heads.
It walks the sequence's blocks through the block table, one cache block (block_size
keys) per iteration, with an online softmax in fp32, and stops at the tile's last
causal key (and starts at its first in-window key under a sliding window).

The grid is fixed by (num_tokens, num_seqs) alone, not by the chunk lengths: sequence s
owns the tiles [query_start[s] // BLOCK_Q + s, query_start[s + 1] // BLOCK_Q + s + 1),
at least as many as its ceil(query_len / BLOCK_Q), so a program finds its sequence by a
binary search over query_start on the device and the host never loops over sequences
(the launch can be captured in a CUDA graph). Surplus tiles return at once.

Triton is a dev dependency (the CPU worker never imports this module); with
TRITON_INTERPRET=1 set before the first import the kernels run on CPU tensors, which is
how tests/worker/test_triton_attention.py checks them on a machine without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagoda.gpu_worker.attention.backend import AttentionMetadata


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding row
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    source = token.to(tl.int64)

    key = tl.load(
        key_ptr + source * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    key_target = block * stride_kc_block + offset * stride_kc_slot
    tl.store(
        key_cache_ptr + key_target + heads[:, None] * stride_kc_head + dims[None, :],
        key.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    value = tl.load(
        value_ptr
        + source * stride_value_token
        + heads[:, None] * stride_value_head
        + dims[None, :],
        mask=mask,
    )
    value_target = block * stride_vc_block + offset * stride_vc_slot
    tl.store(
        value_cache_ptr + value_target + heads[:, None] * stride_vc_head + dims[None, :],
        value.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _paged_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    output_ptr,
    query_start_ptr,
    context_lens_ptr,
    block_table_ptr,
    num_seqs,
    scale,
    softcap,
    sliding_window,
    stride_query_token,
    stride_query_head,
    stride_output_token,
    stride_output_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_table_seq,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PAD matrix rows
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # keys per cache block = keys per iteration
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The sequence owning this tile: the number of s in [1, num_seqs] whose first tile
    # query_start[s] // BLOCK_Q + s is <= tile (first tiles strictly increase with s).
    low = tl.full([], 0, tl.int32)
    high = num_seqs
    while low < high:
        middle = (low + high) // 2
        first_tile = tl.load(query_start_ptr + middle + 1) // BLOCK_Q + middle + 1
        if first_tile <= tile:
            low = middle + 1
        else:
            high = middle
    seq = low
    if seq >= num_seqs:  # a surplus tile past the last sequence
        return
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    tile_in_seq = tile - (query_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= query_len:  # a surplus tile of this sequence
        return
    context_len = tl.load(context_lens_ptr + seq)
    # Positions before this step's chunk: the chunk's rows are the last query_len keys.
    num_prior_keys = context_len - query_len

    rows = tl.arange(0, BLOCK_M)
    token_in_seq = tile_in_seq * BLOCK_Q + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_valid = (token_in_seq < query_len) & (head_in_group < GROUP)
    query_head = kv_head * GROUP + head_in_group
    query_position = num_prior_keys + token_in_seq
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    token = (query_start + token_in_seq).to(tl.int64)
    query = tl.load(
        query_ptr
        + token[:, None] * stride_query_token
        + query_head[:, None] * stride_query_head
        + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )

    # Keys this tile can see: up to its last row's position (causal) and, under a
    # window, from its first row's oldest visible key.
    last_row = tl.minimum((tile_in_seq + 1) * BLOCK_Q, query_len) - 1
    num_visible_keys = num_prior_keys + last_row + 1
    num_blocks = (num_visible_keys + BLOCK_SIZE - 1) // BLOCK_SIZE
    first_block = 0
    if USE_WINDOW:
        first_visible = num_prior_keys + tile_in_seq * BLOCK_Q - sliding_window + 1
        first_block = tl.maximum(first_visible, 0) // BLOCK_SIZE

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    accumulator = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table_seq
    # Within a block: K transposed [HEAD_DIM_PAD, BLOCK_SIZE] for q @ k, V [BLOCK_SIZE, HEAD_DIM_PAD].
    key_in_block = offsets[None, :] * stride_kc_slot + kv_head * stride_kc_head + dims[:, None]
    value_in_block = offsets[:, None] * stride_vc_slot + kv_head * stride_vc_head + dims[None, :]
    # Scores are kept in log2 units for exp2: scale * log2(e) folded into one multiplier.
    log2_scale = scale * 1.4426950408889634

    for block_index in range(first_block, num_blocks):
        block = tl.load(table_row + block_index).to(tl.int64)
        key_position = block_index * BLOCK_SIZE + offsets
        # Slots past the last visible key may hold anything (a reused block's old values):
        # they load as 0, so that 0 * garbage never reaches the sum as NaN.
        key_valid = key_position < num_visible_keys
        key = tl.load(
            key_cache_ptr + block * stride_kc_block + key_in_block,
            mask=dim_valid[:, None] & key_valid[None, :],
            other=0.0,
        )
        value = tl.load(
            value_cache_ptr + block * stride_vc_block + value_in_block,
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        scores = tl.dot(query, key.to(query.dtype), input_precision=DOT_PRECISION)
        if USE_SOFTCAP:
            # softcap * tanh(scale * qk / softcap), with tanh(x) = 2 * sigmoid(2x) - 1.
            capped = 2.0 * tl.sigmoid(scores * (2.0 * scale / softcap)) - 1.0
            scores = capped * (softcap * 1.4426950408889634)
        else:
            scores = scores * log2_scale
        visible = key_position[None, :] <= query_position[:, None]
        if USE_WINDOW:
            visible = visible & (key_position[None, :] > query_position[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))

        block_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row that has seen no visible key yet keeps max -inf: shift by 0 so that
        # exp2(-inf - shift) is 0 and never NaN.
        shift = tl.where(block_max == float("-inf"), 0.0, block_max)
        probabilities = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(running_max - shift)
        running_sum = running_sum * rescale + tl.sum(probabilities, axis=1)
        accumulator = accumulator * rescale[:, None]
        accumulator += tl.dot(
            probabilities.to(value.dtype), value, input_precision=DOT_PRECISION
        ).to(tl.float32)
        running_max = block_max

    output = accumulator / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    tl.store(
        output_ptr
        + token[:, None] * stride_output_token
        + query_head[:, None] * stride_output_head
        + dims[None, :],
        output.to(output_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value [num_tokens, kv_heads, head_dim] into the caches
    [num_blocks, block_size, kv_heads, head_dim] at slot_mapping [num_tokens] (flat slot
    block * block_size + offset; a negative slot skips its row), cast to the cache dtype."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_last_dim_contiguous(key, value, key_cache, value_cache)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
    )


def query_tile(max_query_len: int, group: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M) for a step: 16 matrix rows (tl.dot's minimum) when every chunk
    fits in them, as in a decode-only step; 64 rows (or one token of a wider group) else."""
    group_pad = triton.next_power_of_2(group)
    block_m = 16 if max_query_len * group_pad <= 16 else 64
    block_m = max(block_m, group_pad)
    return block_m // group_pad, block_m


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of query [num_tokens, heads, head_dim] -> same shape and dtype.

    Sequence s owns rows [query_start_loc[s], query_start_loc[s + 1]) at positions
    [context_lens[s] - query_len, context_lens[s]) and reads its keys [0, context_lens[s])
    through block_table[s] (their K/V already written). max_query_len only chooses the
    tile (any upper bound is correct). See the module docstring for the work split.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if output is None:  # contiguous whatever query's layout, as the reference returns
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return output
    _check_last_dim_contiguous(query, output, key_cache, value_cache)
    _check_tile_sizes(key_cache.shape[1], head_dim, compiled=query.device.type != "cpu")
    group = num_heads // num_kv_heads
    block_q, block_m = query_tile(max_query_len, group)
    num_tiles = num_tokens // block_q + num_seqs
    _paged_attention_kernel[(num_tiles, num_kv_heads)](
        query,
        key_cache,
        value_cache,
        output,
        query_start_loc,
        context_lens,
        block_table,
        num_seqs,
        scale,
        1.0 if softcap is None else softcap,
        0 if sliding_window is None else sliding_window,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
        USE_SOFTCAP=softcap is not None,
        USE_WINDOW=sliding_window is not None,
        # fp32 stays fp32 (tl.dot's default is tf32 on CUDA); half types use the default.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return output


def _check_tile_sizes(block_size: int, head_dim: int, compiled: bool) -> None:
    """One cache block is one key tile, so tl.arange needs a power-of-two block size; a
    compiled tl.dot needs 16 or more along every side (the interpreter, on CPU, does not)."""
    if block_size & (block_size - 1):
        raise ValueError(f"the triton backend needs a power-of-two block size, not {block_size}")
    if compiled and min(block_size, triton.next_power_of_2(head_dim)) < 16:
        raise ValueError(
            f"the triton backend needs a block size and head size of 16 or more on a GPU, "
            f"not {block_size} and {head_dim}"
        )


def _check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.stride(-1) != 1:
            raise ValueError("the kernels need a unit stride along head_dim")


class TritonBackend:
    """pagoda.gpu_worker.attention.backend.AttentionBackend over the two kernels above."""

    name = "triton"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)

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
        # The chunk's own keys are read back from the cache (written just before), so
        # `key` and `value` are not needed here.
        return paged_attention(
            query,
            key_cache,
            value_cache,
            metadata.query_start_loc,
            metadata.context_lens,
            metadata.block_table,
            max_query_len=metadata.max_query_len,
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
        )
