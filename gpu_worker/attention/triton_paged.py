"""The Triton paged-attention backend: one fused KV write and one attention launch per layer.

`write_kv` stores each row's key/value at its slot with one program per token (a slot
below zero is a padding row and is skipped, so a padded batch needs no host-side trim).

`paged_attention` runs decode rows and prefill chunks of any length in one launch. A
program owns one query tile of one sequence (BLOCK_Q consecutive rows) and one KV head.
Its BLOCK_M = BLOCK_Q * GROUP_PAD matrix rows are (token, query head of that KV head's
group) pairs, so the KV of a grouped-query head is read once for all its query heads.
It walks the sequence's keys TILE_N at a time, each key's cache block looked up through
the block table (so the key tile and the cache block size are independent: any block
size works, and a large block does not make a large tile), with an online softmax in
fp32, and stops at the tile's last causal key (and starts at its first in-window key
under a sliding window).

Split-KV: when a decode-only step has too few (sequence, KV head) programs to fill the
GPU, each one's keys are cut into NUM_SEGMENTS ranges run by programs of their own; each
writes its partial softmax state (max, sum, weighted values) and `_reduce_segments_kernel`
merges them. The segment count depends only on the batch size, never on the context
lengths, so a captured CUDA graph replays the same launch for any context.

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


@triton.jit(do_not_specialize=["num_seqs", "stride_table_seq"])
def _paged_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    output_ptr,
    segment_max_ptr,  # [num_tokens, heads, NUM_SEGMENTS] fp32 (split-KV only)
    segment_sum_ptr,
    segment_output_ptr,  # [num_tokens, heads, NUM_SEGMENTS, HEAD_DIM_PAD] fp32
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
    BLOCK_SIZE: tl.constexpr,  # keys per cache block (any size)
    TILE_N: tl.constexpr,  # keys per iteration (a power of two, 16 or more compiled)
    NUM_SEGMENTS: tl.constexpr,  # key ranges per (tile, KV head); 1: no split
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

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
    num_key_tiles = (num_visible_keys + TILE_N - 1) // TILE_N
    first_key_tile = 0
    if USE_WINDOW:
        first_visible = num_prior_keys + tile_in_seq * BLOCK_Q - sliding_window + 1
        first_key_tile = tl.maximum(first_visible, 0) // TILE_N
    if NUM_SEGMENTS > 1:  # this program's share of the key tiles
        per_segment = (num_key_tiles - first_key_tile + NUM_SEGMENTS - 1) // NUM_SEGMENTS
        first_key_tile = first_key_tile + segment * per_segment
        num_key_tiles = tl.minimum(num_key_tiles, first_key_tile + per_segment)

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    accumulator = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    offsets = tl.arange(0, TILE_N)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table_seq
    # Scores are kept in log2 units for exp2: scale * log2(e) folded into one multiplier.
    log2_scale = scale * 1.4426950408889634

    for key_tile in range(first_key_tile, num_key_tiles):
        key_position = key_tile * TILE_N + offsets
        # Slots past the last visible key may hold anything (a reused block's old values):
        # they load as 0, so that 0 * garbage never reaches the sum as NaN.
        key_valid = key_position < num_visible_keys
        block = tl.load(table_row + key_position // BLOCK_SIZE, mask=key_valid, other=0)
        slot = block.to(tl.int64) * stride_kc_block + (key_position % BLOCK_SIZE) * stride_kc_slot
        # K transposed [HEAD_DIM_PAD, TILE_N] for q @ k, V [TILE_N, HEAD_DIM_PAD].
        key = tl.load(
            key_cache_ptr + slot[None, :] + kv_head * stride_kc_head + dims[:, None],
            mask=dim_valid[:, None] & key_valid[None, :],
            other=0.0,
        )
        value_slot = (
            block.to(tl.int64) * stride_vc_block + (key_position % BLOCK_SIZE) * stride_vc_slot
        )
        value = tl.load(
            value_cache_ptr + value_slot[:, None] + kv_head * stride_vc_head + dims[None, :],
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

    if NUM_SEGMENTS > 1:  # the partial state, merged by _reduce_segments_kernel
        state = (token[:, None] * (GROUP * tl.num_programs(1)) + query_head[:, None]) * NUM_SEGMENTS
        state = state + segment
        tl.store(segment_max_ptr + state, running_max[:, None], mask=row_valid[:, None])
        tl.store(segment_sum_ptr + state, running_sum[:, None], mask=row_valid[:, None])
        tl.store(
            segment_output_ptr + state * HEAD_DIM_PAD + dims[None, :],
            accumulator,
            mask=row_valid[:, None] & dim_valid[None, :],
        )
        return
    output = accumulator / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    tl.store(
        output_ptr
        + token[:, None] * stride_output_token
        + query_head[:, None] * stride_output_head
        + dims[None, :],
        output.to(output_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


@triton.jit
def _reduce_segments_kernel(
    output_ptr,
    segment_max_ptr,
    segment_sum_ptr,
    segment_output_ptr,
    stride_output_token,
    stride_output_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """One (token, query head): the segments' softmax states merged into its output row."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    state = (token * NUM_HEADS + head) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)
    maxima = tl.load(segment_max_ptr + state)
    overall = tl.max(maxima, axis=0)
    # A segment that saw no key has max -inf and weight 0; all -inf cannot happen (a row
    # always sees its own key), but shifting by 0 then keeps it NaN-free all the same.
    shift = tl.where(overall == float("-inf"), 0.0, overall)
    weights = tl.exp2(maxima - shift)
    total = tl.sum(tl.load(segment_sum_ptr + state) * weights, axis=0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    partial = tl.load(segment_output_ptr + state[:, None] * HEAD_DIM_PAD + dims[None, :])
    merged = tl.sum(partial * weights[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        output_ptr + token * stride_output_token + head * stride_output_head + dims,
        merged.to(output_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
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
    num_segments: int | None = None,
) -> torch.Tensor:
    """Causal paged attention of query [num_tokens, heads, head_dim] -> same shape and dtype.

    Sequence s owns rows [query_start_loc[s], query_start_loc[s + 1]) at positions
    [context_lens[s] - query_len, context_lens[s]) and reads its keys [0, context_lens[s])
    through block_table[s] (their K/V already written). max_query_len only chooses the
    tile (any upper bound is correct). num_segments (a power of two) overrides the split-KV
    choice of split_kv_segments. See the module docstring for the work split.
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
    _check_head_size(head_dim, compiled=query.device.type != "cpu")
    group = num_heads // num_kv_heads
    block_q, block_m = query_tile(max_query_len, group)
    num_tiles = num_tokens // block_q + num_seqs
    head_dim_pad = triton.next_power_of_2(head_dim)
    segments = num_segments if num_segments is not None else split_kv_segments(
        num_seqs, num_kv_heads, max_query_len, query.device
    )  # fmt: skip
    if segments > 1:
        state_shape = (num_tokens, num_heads, segments)
        segment_max = torch.empty(state_shape, dtype=torch.float32, device=query.device)
        segment_sum = torch.empty(state_shape, dtype=torch.float32, device=query.device)
        segment_output = torch.empty(
            (*state_shape, head_dim_pad), dtype=torch.float32, device=query.device
        )
    else:  # never read: any fp32 tensor will do
        segment_max = segment_sum = segment_output = output
    tile_n = key_tile(head_dim, block_m)
    _paged_attention_kernel[(num_tiles, num_kv_heads, segments)](
        query,
        key_cache,
        value_cache,
        output,
        segment_max,
        segment_sum,
        segment_output,
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
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=key_cache.shape[1],
        TILE_N=tile_n,
        NUM_SEGMENTS=segments,
        USE_SOFTCAP=softcap is not None,
        USE_WINDOW=sliding_window is not None,
        # fp32 stays fp32 (tl.dot's default is tf32 on CUDA); half types use the default.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        **launch_options(block_m),
    )
    if segments > 1:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            output,
            segment_max,
            segment_sum,
            segment_output,
            output.stride(0),
            output.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SEGMENTS=segments,
        )
    return output


# Split-KV aims at this many programs: a few per streaming multiprocessor (132 on an H100).
TARGET_PROGRAMS = 512
MAX_SEGMENTS = 32


def split_kv_segments(num_seqs: int, num_kv_heads: int, max_query_len: int, device) -> int:
    """Key ranges per (sequence, KV head) for a step: more than one only for a decode-only
    step whose sequences alone leave the GPU mostly idle (a batch of 1 at any context has
    as many programs as KV heads). A power of two fixed by the batch, not the contexts."""
    if max_query_len != 1 or device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    segments = 1
    while segments < MAX_SEGMENTS and programs * segments * 2 <= TARGET_PROGRAMS:
        segments *= 2
    return segments


def key_tile(head_dim: int, block_m: int) -> int:
    """Keys per iteration: 64 while the K and V tiles stay within registers and shared
    memory at this head size, 32 at a head size of 256 with 64 query rows."""
    return 32 if triton.next_power_of_2(head_dim) * block_m > 128 * 64 else 64


def launch_options(block_m: int) -> dict[str, int]:
    """num_warps and num_stages by query tile: a decode tile (16 matrix rows) pipelines one
    more key tile ahead. `make gpu-check`'s tune step sweeps these and key_tile's choice."""
    return {"num_warps": 4, "num_stages": 3 if block_m == 16 else 2}


def _check_head_size(head_dim: int, compiled: bool) -> None:
    """A compiled tl.dot needs 16 or more along every side (the interpreter does not); the
    key tile is 32 or 64 whatever the block size, so only the head size can be too small."""
    if compiled and triton.next_power_of_2(head_dim) < 16:
        raise ValueError(
            f"the triton backend needs a head size of 16 or more on a GPU, not {head_dim}"
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
