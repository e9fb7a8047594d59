"""Batch-invariant attention for the CPU: a query row's output depends only on its own
query, keys and values, never on the rows it shares a call with or on how many keys the
call is padded to (STYLE.md habit 18).

PyTorch's CPU SDPA is not: its flash kernel splits queries and keys by the call's sizes,
and its softmax and P.V sums change their order with the padded key count (measured here:
a decode row gave other bits alone, beside a longer row, and as the last row of a
prefill). So every reduction here has a fixed shape:
- q.k: one matmul whose reduction is head_dim; the rows of a call are padded to a
  multiple of ROW_MULTIPLE (oneDNN/MKL take other kernels for a few rows: 1-3 on an AMD
  EPYC; on an Intel Xeon with AVX-512, at head sizes of 128 and 256, up to 15, so a
  multiple of 4 was not enough there);
- the softmax denominator and P.V are summed per KEY_BLOCK keys (fixed-size sums), then
  across blocks with cumsum, which adds in order: blocks of padding add exact zeros.
tests/worker/test_batch_invariance.py holds this to bit-exact logprobs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KEY_BLOCK = 64
ROW_MULTIPLE = 16
# A causal prefill attends in blocks of this many queries, each over the keys up to its
# last query (rounded up to KEY_BLOCK): the masked upper triangle is mostly not computed.
# A row's result is the same either way (its extra keys are masked: exact zeros).
QUERY_BLOCK = 128


def attend_batch_invariant(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    is_causal: bool = False,
) -> torch.Tensor:
    """softmax(q k^T * scale [+ mask]) v, as reference.attend: q [..., Hq, Lq, d], k/v
    [..., Hk, Lk, d] (Hq a multiple of Hk), mask broadcastable to [..., Lq, Lk] (True:
    attend)."""
    *batch, num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_keys = key.shape[-3], key.shape[-2]
    group = num_heads // num_kv_heads
    if is_causal and mask is None:
        mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=query.device)
        mask = mask.tril(num_keys - num_queries)
    if num_queries > QUERY_BLOCK and mask is not None and mask.dim() == 2:
        # A prefill (a 2-D mask: its rows see keys up to their positions, no further).
        offset = num_keys - num_queries
        parts = []
        for start in range(0, num_queries, QUERY_BLOCK):
            end = min(start + QUERY_BLOCK, num_queries)
            seen = min(num_keys, -(-(end + offset) // KEY_BLOCK) * KEY_BLOCK)
            parts.append(
                attend_batch_invariant(
                    query[..., start:end, :],
                    key[..., :seen, :],
                    value[..., :seen, :],
                    mask[start:end, :seen],
                    scale,
                    softcap,
                )
            )
        return torch.cat(parts, dim=-2)
    # Query heads sharing a KV head become rows of one product: [..., Hk, group * Lq, d].
    rows = query.reshape(*batch, num_kv_heads, group * num_queries, head_dim)
    num_rows = rows.shape[-2]
    padded_rows = -(-num_rows // ROW_MULTIPLE) * ROW_MULTIPLE
    padded_keys = -(-num_keys // KEY_BLOCK) * KEY_BLOCK
    if padded_rows != num_rows:
        rows = F.pad(rows, (0, 0, 0, padded_rows - num_rows))
    if padded_keys != num_keys:
        key = F.pad(key, (0, 0, 0, padded_keys - num_keys))
        value = F.pad(value, (0, 0, 0, padded_keys - num_keys))
    scores = torch.matmul(rows, key.transpose(-1, -2)).mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    scores = scores[..., :num_rows, :].reshape(
        *batch, num_kv_heads, group, num_queries, padded_keys
    )
    allowed = torch.zeros(padded_keys, dtype=torch.bool, device=query.device)
    allowed[:num_keys] = True
    if mask is not None:
        # mask: [..., 1 or Hq, Lq, Lk] or [Lq, Lk]; seen per KV head and group.
        if mask.dim() >= 3 and mask.shape[-3] == num_heads and num_heads > 1:
            mask = mask.reshape(*mask.shape[:-3], num_kv_heads, group, *mask.shape[-2:])
        elif mask.dim() >= 3:
            mask = mask.unsqueeze(-3)
        allowed = F.pad(mask, (0, padded_keys - num_keys)) & allowed
    scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(top).exp_()  # masked keys: exactly 0
    weights = weights.reshape(*batch, num_kv_heads, num_rows, padded_keys)
    num_blocks = padded_keys // KEY_BLOCK
    blocked = weights.view(*batch, num_kv_heads, num_rows, num_blocks, KEY_BLOCK)
    denominator = blocked.sum(dim=-1).cumsum(dim=-1)[..., -1:]  # [..., Hk, rows, 1]
    if padded_rows != num_rows:
        blocked = F.pad(blocked, (0, 0, 0, 0, 0, padded_rows - num_rows))
    # [..., Hk, blocks, rows, KEY_BLOCK] @ [..., Hk, blocks, KEY_BLOCK, d]
    values = value.reshape(*value.shape[:-2], num_blocks, KEY_BLOCK, head_dim)
    partial = torch.matmul(blocked.transpose(-3, -2), values)
    output = partial.cumsum(dim=-3)[..., -1, :num_rows, :].div_(denominator)
    return output.reshape(*batch, num_heads, num_queries, head_dim).contiguous()
