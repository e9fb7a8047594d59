"""Fused Triton kernels for the dense parts of a decoder layer on CUDA.

Hugging Face's model code runs RMSNorm as pow/mean/rsqrt/mul, the residual add apart,
SiLU(gate) * up as three kernels after two GEMMs and RoPE as cat/neg/mul/add: about 700
small kernels per decode step of Qwen3-0.6B (docs/benchmarks.md, the second lease). Each
function here is one launch:

- `rms_norm(x, weight, eps, residual=None)`: RMSNorm over the last dimension; with
  `residual`, the sum x + residual is formed first, normalised and also returned (the
  residual stream of the next sub-layer), so the add costs no kernel of its own.
- `silu_and_mul(gate_up)`: SiLU(gate) * up over one [rows, 2 * intermediate] GEMM output.
- `rotary_in_place(query, key, positions, cos_sin)`: Llama/NeoX-style RoPE (rotate_half)
  on query and key in place, each row's cos/sin gathered from a table by its position.
- `qk_norm_rotary_in_place(query, key, q_weight, k_weight, ...)`: Qwen3's per-head q_norm
  and k_norm, then that RoPE, in one launch instead of three.

Numerics follow the torch expressions they replace, with the same roundings to the input
dtype where those round (the sum before the norm, the normalised value before the weight,
SiLU before the product); reductions are fp32. RoPE rounds as HF's expression does, bit for
bit: cos/sin and each product to the model dtype, then the sum. It is compiled without
floating-point contraction (`ROTARY_OPTIONS`): with it, sm_90 code fused a product and the
sum into one fma.rn.bf16, which skips the product's rounding (the H200 lease of 2026-11-29
found elements off in bfloat16 and in float32 on every shape tested). Shapes come from the
tensors alone and nothing reads back to the host, so every launch can be captured in a CUDA
graph.

Triton is needed (CUDA paths only; pagoda.gpu_worker.fused_model decides when). With
TRITON_INTERPRET=1 set before triton is first imported the kernels run on CPU tensors:
tests/worker/test_fused_ops.py checks them there against the torch expressions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # Rounded to the stream's dtype as `residual + hidden_states` is.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / num_cols
    normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_gate_up,
    stride_out,
    num_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    gate = tl.load(gate_up_ptr + row * stride_gate_up + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_gate_up + num_cols + cols, mask=mask, other=0.0)
    gate_f = gate.to(tl.float32)
    activated = (gate_f / (1.0 + tl.exp(-gate_f))).to(gate.dtype)  # F.silu's rounding
    out = activated.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotated(x1, x2, cos, sin, dtype):
    """(x1 cos - x2 sin, x2 cos + x1 sin) of float32 values, rounded where HF's
    apply_rotary_pos_emb rounds in the activations' `dtype`: the table cast to it, each
    product, then the sum (left to the caller's store; float32: no rounding at all)."""
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    x1_cos = (x1 * cos).to(dtype).to(tl.float32)
    x2_sin = (x2 * sin).to(dtype).to(tl.float32)
    x2_cos = (x2 * cos).to(dtype).to(tl.float32)
    x1_sin = (x1 * sin).to(dtype).to(tl.float32)
    return x1_cos - x2_sin, x2_cos + x1_sin


@triton.jit
def _rotate_heads(
    first, weight_ptr, eps, HALF: tl.constexpr, mask, dims, cos, sin, NORMS: tl.constexpr
):
    """RoPE in place on the [heads, HALF] first halves at `first` and their second halves.
    With NORMS, Qwen3's per-head RMSNorm (weights at `weight_ptr`) first, rounded as
    `rms_norm` rounds (the normalised value to the dtype, then its product with the
    weight): the rotation reads that rounded output from registers."""
    dtype = first.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORMS:
        variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        scale = tl.rsqrt(variance + eps)[:, None]
        dim_mask = dims < HALF
        weight1 = tl.load(weight_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)
        weight2 = tl.load(weight_ptr + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)
        x1 = (weight1[None, :] * (x1 * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (weight2[None, :] * (x2 * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    out1, out2 = _rotated(x1, x2, cos, sin, dtype)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    query_ptr,
    key_ptr,
    query_weight_ptr,
    key_weight_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_query_token,
    stride_query_head,
    stride_key_token,
    stride_key_head,
    query_eps,
    key_eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NORMS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    heads = tl.arange(0, HEADS_PAD)
    dim_mask = dims < HALF
    cos = tl.load(cos_sin_ptr + position * (2 * HALF) + dims, mask=dim_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * (2 * HALF) + HALF + dims, mask=dim_mask, other=0.0)
    cos = cos[None, :]
    sin = sin[None, :]

    mask = (heads[:, None] < NUM_HEADS) & dim_mask[None, :]
    first = query_ptr + token * stride_query_token + heads[:, None] * stride_query_head
    first = first + dims[None, :]
    _rotate_heads(first, query_weight_ptr, query_eps, HALF, mask, dims, cos, sin, NORMS)

    mask = (heads[:, None] < NUM_KV_HEADS) & dim_mask[None, :]
    first = key_ptr + token * stride_key_token + heads[:, None] * stride_key_head
    first = first + dims[None, :]
    _rotate_heads(first, key_weight_ptr, key_eps, HALF, mask, dims, cos, sin, NORMS)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] without a copy where its layout allows (unit last stride)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * RMSNorm(x) over the last dimension, as HF's LlamaRMSNorm/Qwen3RMSNorm, in
    the dtype of `weight * x` (torch's promotion). With `residual` (x's shape and dtype):
    (that of x + residual, x + residual), the second being the next residual stream."""
    shape = x.shape
    rows = _rows(x)
    num_rows, num_cols = rows.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((num_rows, num_cols), dtype=out_dtype, device=x.device)
    residual_rows = residual_out = rows  # never read without a residual
    if residual is not None:
        residual_rows = _rows(residual)
        residual_out = torch.empty_like(rows)
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            rows,
            residual_rows,
            weight,
            out,
            residual_out,
            rows.stride(0),
            residual_rows.stride(0),
            out.stride(0),
            residual_out.stride(0),
            num_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(num_cols),
            num_warps=_warps_for(num_cols),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), residual_out.view(shape)


SILU_BLOCK = 1024


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [..., 2 * n] (gate the first half, up the second) ->
    [..., n], as HF's `act_fn(gate_proj(x)) * up_proj(x)` with act_fn SiLU."""
    rows = _rows(gate_up)
    num_rows, width = rows.shape
    num_cols = width // 2
    out = torch.empty((num_rows, num_cols), dtype=gate_up.dtype, device=gate_up.device)
    block = min(SILU_BLOCK, triton.next_power_of_2(num_cols))
    if num_rows:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(num_cols, block))](
            rows, out, rows.stride(0), out.stride(0), num_cols, BLOCK=block, num_warps=4
        )
    return out.view(*gate_up.shape[:-1], num_cols)


# No floating-point contraction: an FMA of a product and the sum skips the product's rounding.
ROTARY_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


def rotary_in_place(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
) -> None:
    """RoPE on query [T, heads, head_dim] and key [T, kv_heads, head_dim] in place (unit
    stride along head_dim), token t at positions[t] (< cos_sin's rows): for each half
    pair (x1, x2), (x1 cos - x2 sin, x2 cos + x1 sin), as HF's apply_rotary_pos_emb."""
    _launch_rotary(query, key, positions, cos_sin, None)


def qk_norm_rotary_in_place(
    query: torch.Tensor,
    key: torch.Tensor,
    query_weight: torch.Tensor,
    key_weight: torch.Tensor,
    query_eps: float,
    key_eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
) -> None:
    """Qwen3's q_norm and k_norm (RMSNorm over each head, weights [head_dim] in the
    activations' dtype), then `rotary_in_place`'s RoPE, on query and key in place: one
    launch where there were three, each value as `rms_norm` then `rotary_in_place` compute
    it (the norm's sum of squares may add in another order)."""
    head_dim = query.shape[-1]
    for weight in (query_weight, key_weight):
        if weight.shape != (head_dim,) or weight.dtype != query.dtype or not weight.is_contiguous():
            raise ValueError(
                f"a norm weight of shape {tuple(weight.shape)} and {weight.dtype} for heads "
                f"of {head_dim} in {query.dtype}"
            )
    _launch_rotary(query, key, positions, cos_sin, (query_weight, key_weight, query_eps, key_eps))


def _launch_rotary(query, key, positions, cos_sin, norms) -> None:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("RoPE in place needs a unit stride along head_dim")
    if cos_sin.shape[1] != head_dim:
        raise ValueError(f"a rotary table of width {cos_sin.shape[1]} for head_dim {head_dim}")
    if num_tokens == 0:
        return
    # Without norms the weight pointers are never read.
    query_weight, key_weight, query_eps, key_eps = norms or (query, key, 0.0, 0.0)
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        query_weight,
        key_weight,
        positions,
        cos_sin,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        query_eps,
        key_eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(max(num_heads, num_kv_heads)),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        NORMS=norms is not None,
        **ROTARY_OPTIONS,
    )


def _warps_for(num_cols: int) -> int:
    """Warps for one row of `num_cols`: enough that each thread holds a few elements."""
    return max(1, min(16, triton.next_power_of_2(num_cols) // 256))
