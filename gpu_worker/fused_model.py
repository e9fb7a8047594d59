"""Swap the fused kernels of pagoda.gpu_worker.fused_ops into a loaded Llama/Qwen3 model.

`fuse_model(model, num_positions)` patches, in place and once (a second call finds
nothing left to do):
- every RMSNorm module (the layer norms, the final norm, Qwen3's per-head q_norm/k_norm):
  one `rms_norm` launch each;
- every decoder layer: the residual add after attention is fused into the
  post-attention norm (`rms_norm(..., residual=)`);
- every MLP whose gate and up projections are plain bias-free Linear layers with a SiLU
  activation: the two become one `gate_up_proj` Linear (one GEMM, weights concatenated,
  the old ones freed) followed by `silu_and_mul`;
- every attention module of a static RoPE type: q/k get RoPE in place from a cos/sin
  table gathered by position_ids (built once, `num_positions` rows, shared by the layers);
  with the Triton kernels, Qwen3's q_norm/k_norm and that RoPE are one launch
  (`qk_norm_rotary_in_place`), and q, k and v projections that are plain Linear layers
  become one `qkv_proj` Linear (one GEMM, weights concatenated, the old ones freed).

What it does not know it leaves as loaded (another architecture, a sharded projection, a
dynamic RoPE). The ops are fused_ops.py's Triton kernels, which the paged engine patches in
on CUDA with the triton attention backend, or the CPU kernels' (cpu_kernels.py,
elementwise.c), patched in on the CPU under `int8`, where gate and up are already one Q4_1
GEMM (quantization.FusedQ4Linear) and that GEMM is called as `gate_up_proj`; the CPU ops
are batch-invariant like the rest of that path (tests/worker/test_batch_invariance.py).
tests/worker/test_fused_ops.py compares a patched tiny Llama and Qwen3 with the unpatched
ones under the Triton interpreter, tests/worker/test_cpu_fused_ops.py with the CPU ops.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass

import torch

log = logging.getLogger("pagoda.worker.engine")  # beside the engine's load lines

FUSED_MODEL_TYPES = ("llama", "qwen3")
# RoPE types whose cos/sin depend on the position alone (inv_freq fixed at load).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(slots=True)
class FusedCounts:
    norms: int = 0
    layers: int = 0
    mlps: int = 0
    attentions: int = 0
    joined_qkv: int = 0

    @property
    def total(self) -> int:
        return self.norms + self.layers + self.mlps + self.attentions + self.joined_qkv


def fuse_model(model: torch.nn.Module, num_positions: int, ops=None) -> FusedCounts:
    """Patch `model` in place (see the module docstring) with `ops` (an object with
    fused_ops' rms_norm, silu_and_mul and rotary_in_place; None: fused_ops' Triton
    kernels); returns what was patched now."""
    counts = FusedCounts()
    model_type = getattr(model.config.get_text_config(), "model_type", None)
    if model_type not in FUSED_MODEL_TYPES:
        log.info("no fused kernels for model type %s", model_type)
        return counts
    join_qkv = ops is None  # on the CPU, q/k/v are already one Q4_1 GEMM (or the reference)
    if ops is None:
        from pagoda.gpu_worker import fused_ops as ops
    cos_sin = _rotary_table(model, num_positions)
    for module in list(model.modules()):  # the MLPs change their children
        if getattr(module, "_pagoda_fused", False):
            continue
        name = type(module).__name__
        if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_norm_forward, module)
            counts.norms += 1
        elif name.endswith("DecoderLayer") and _has_layer_layout(module):
            module.forward = types.MethodType(_layer_forward, module)
            counts.layers += 1
        elif name.endswith("MLP") and _fuse_gate_up(module):
            module.forward = types.MethodType(_mlp_forward, module)
            counts.mlps += 1
        elif name.endswith("Attention") and cos_sin is not None and hasattr(module, "q_proj"):
            module.rotary_cos_sin = cos_sin
            if join_qkv and _fuse_qkv(module):
                counts.joined_qkv += 1
            module.forward = types.MethodType(_attention_forward, module)
            counts.attentions += 1
        else:
            continue
        module._pagoda_fused = True
        module._pagoda_ops = ops
    if counts.total:
        log.info(
            "fused kernels: %d RMSNorms, %d residual adds, %d gate/up+SiLU, %d RoPE, "
            "%d q/k/v projections as one GEMM",
            counts.norms,
            counts.layers,
            counts.mlps,
            counts.attentions,
            counts.joined_qkv,
        )
    return counts


def cpu_fusable(model: torch.nn.Module) -> bool:
    """Whether the CPU kernels' ops (elementwise.c: float32, widths in whole vectors of 8)
    fit every width `fuse_model` would give them."""
    text = model.config.get_text_config()
    if getattr(text, "model_type", None) not in FUSED_MODEL_TYPES:
        return False
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    widths = (text.hidden_size, text.intermediate_size, head_dim // 2)
    parameter = next(model.parameters())
    return parameter.dtype == torch.float32 and all(width % 8 == 0 for width in widths)


def rotary_cos_sin(inv_freq: torch.Tensor, num_positions: int, scaling: float) -> torch.Tensor:
    """The table `rotary_in_place` reads: row p is cos(p * inv_freq) * scaling, then
    sin(p * inv_freq) * scaling, fp32 [num_positions, head_dim], computed as HF's rotary
    embedding computes them (fp32 product of the position and the frequency)."""
    positions = torch.arange(num_positions, device=inv_freq.device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1).contiguous()


def _rotary_table(model: torch.nn.Module, num_positions: int) -> torch.Tensor | None:
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", None) not in STATIC_ROPE_TYPES:
        return None
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if rotary.inv_freq.numel() * 2 != head_dim:  # partial rotary: not this kernel's
        return None
    return rotary_cos_sin(rotary.inv_freq, num_positions, float(rotary.attention_scaling))


def _has_layer_layout(layer: torch.nn.Module) -> bool:
    return all(
        hasattr(layer, name)
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
    )


def _fuse_gate_up(mlp: torch.nn.Module) -> bool:
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if getattr(mlp.config, "hidden_act", None) not in ("silu", "swish"):
        return False
    joined = _joined_q4(gate, up)
    if joined is not None:  # already one GEMM (quantization.FusedQ4Linear): call it
        mlp.gate_up_proj = joined
        return True
    if any(getattr(m, "bias", None) is not None for m in (gate, up)):
        return False
    return _join_linears(mlp, ("gate_proj", "up_proj"), "gate_up_proj") is not None


def _fuse_qkv(attention: torch.nn.Module) -> bool:
    """q_proj, k_proj and v_proj as one `qkv_proj` Linear, their output widths kept as
    `qkv_widths`; else leaves them."""
    widths = _join_linears(attention, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
    if widths is None:
        return False
    attention.qkv_widths = widths
    return True


def _join_linears(
    parent: torch.nn.Module, names: tuple[str, ...], joined_name: str
) -> list[int] | None:
    """`parent`'s Linear layers `names` as one Linear `joined_name` (one GEMM, weights and
    biases concatenated in that order, the old layers freed) when all are plain Linear
    layers alike (dtype, device, input, bias or none); returns their output widths, or None
    and leaves them."""
    layers = [getattr(parent, name, None) for name in names]
    if not all(type(m) is torch.nn.Linear for m in layers):
        return None
    alike = {(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in layers}
    if len(alike) != 1:
        return None
    first = layers[0]
    widths = [m.out_features for m in layers]
    joined = torch.nn.Linear(
        first.in_features,
        sum(widths),
        bias=first.bias is not None,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        joined.weight.copy_(torch.cat([m.weight for m in layers]))
        if first.bias is not None:
            joined.bias.copy_(torch.cat([m.bias for m in layers]))
    joined.requires_grad_(False)
    setattr(parent, joined_name, joined)
    for name in names:  # one copy of the weights
        delattr(parent, name)
    return widths


def _joined_q4(gate, up) -> torch.nn.Module | None:
    """The Q4Linear computing [gate | up] when gate and up are the two Q4Slices of one
    FusedQ4Linear, in that order; else None."""
    from pagoda.gpu_worker.quantization import Q4Slice

    if not (isinstance(gate, Q4Slice) and isinstance(up, Q4Slice)) or gate.fused is not up.fused:
        return None
    width = gate.fused.layer.out_features
    if (gate.start, gate.end, up.start, up.end) != (0, width // 2, width // 2, width):
        return None
    return gate.fused.layer


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return self._pagoda_ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(self._pagoda_ops.silu_and_mul(self.gate_up_proj(x)))


def _layer_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values=None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
) -> torch.Tensor:
    """HF's Llama/Qwen3 decoder layer with the post-attention residual add in the norm."""
    norm = self.post_attention_layernorm
    attention, _ = self.self_attn(
        hidden_states=self.input_layernorm(hidden_states),
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    normed, residual = self._pagoda_ops.rms_norm(
        attention, norm.weight, norm.variance_epsilon, residual=hidden_states
    )
    return residual + self.mlp(normed)


def _attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values=None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's Llama/Qwen3 attention with RoPE in place from the shared cos/sin table (the
    model's position_embeddings are not read); the attention itself is the configured
    attention interface (pagoda's paged one in the engine), called as HF calls it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if past_key_values is not None:
        raise RuntimeError("the fused attention keeps no Hugging Face KV cache")
    input_shape = hidden_states.shape[:-1]
    head_dim = self.head_dim
    ops = self._pagoda_ops
    if hasattr(self, "qkv_proj"):  # views of one GEMM's output
        query, key, value = self.qkv_proj(hidden_states).split(self.qkv_widths, dim=-1)
    else:
        query = self.q_proj(hidden_states)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)
    # Heads from the projections' widths, not the config (a sharded rank holds fewer).
    query = query.view(-1, query.shape[-1] // head_dim, head_dim)
    key = key.view(-1, key.shape[-1] // head_dim, head_dim)
    value = value.view(*input_shape, -1, head_dim).transpose(1, 2)
    qk_norms = hasattr(self, "q_norm")  # Qwen3: RMSNorm over each head
    if (
        qk_norms
        and position_ids is not None
        and hasattr(ops, "qk_norm_rotary_in_place")
        and self.q_norm.weight.dtype == self.k_norm.weight.dtype == query.dtype
    ):
        ops.qk_norm_rotary_in_place(
            query,
            key,
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.variance_epsilon,
            self.k_norm.variance_epsilon,
            position_ids.reshape(-1),
            self.rotary_cos_sin,
        )
    else:
        if qk_norms:
            query, key = self.q_norm(query), self.k_norm(key)
        if position_ids is not None:
            ops.rotary_in_place(query, key, position_ids.reshape(-1), self.rotary_cos_sin)
        else:  # a caller that passes no position_ids: HF's own expression on its cos/sin
            query, key = _rotary_from_embeddings(query, key, position_embeddings)
    interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    output, _ = interface(
        self,
        query.view(*input_shape, *query.shape[1:]).transpose(1, 2),
        key.view(*input_shape, *key.shape[1:]).transpose(1, 2),
        value,
        attention_mask,
        dropout=0.0,
        scaling=self.scaling,
        sliding_window=getattr(self, "sliding_window", None),
        **kwargs,
    )
    return self.o_proj(output.reshape(*input_shape, -1).contiguous()), None


def _rotary_from_embeddings(query, key, position_embeddings):
    """HF's apply_rotary_pos_emb on [T, heads, d] from the model's (cos, sin) [1, T, d]."""
    cos, sin = (t.reshape(-1, 1, t.shape[-1]) for t in position_embeddings)
    half = query.shape[-1] // 2

    def rotate_half(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin
