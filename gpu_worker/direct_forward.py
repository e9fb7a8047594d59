"""The CPU fast path's forward without transformers' module calls.

On the CPU under `int8` a Llama or Qwen3 model runs on Pagoda's kernels alone: the
decoder's Linear layers as Q4_1 GEMMs (quantization.py; q/k/v and gate/up one call each),
the norms, SiLU*up and RoPE on elementwise.c (fused_model.py), the attention on the
configured backend, the head rescored. What transformers' code still adds is glue: a
dozen module calls a layer, keyword arguments handed down to each, position embeddings
and a mask it builds and never reads. At one row that glue was a third of a decode step
(3.2 of 9.7 ms on two Zen 5 cores).

`DirectForward.of(model, kernels)` reads those parts off a model patched that way and
runs the same kernels in the same order on the same tensors, so its logits are the model
call's, bit for bit (tests/worker/test_direct_forward.py); it returns None, with the
reason logged, when a part is not what it expects, and the engine then calls the model.
`--no-fused-ops` leaves the model unpatched, so it turns this off too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagoda.gpu_worker.attention.backend import AttentionBackend
from pagoda.gpu_worker.kv_pool import KVPool
from pagoda.gpu_worker.paged_attention import attend
from pagoda.gpu_worker.quantization import Q4Linear, Q4Slice
from pagoda.gpu_worker.ragged_batch import RaggedBatch

log = logging.getLogger("pagoda.worker.engine")


@dataclass(frozen=True, slots=True)
class _Norm:
    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, module) -> _Norm | None:
        if not getattr(module, "_pagoda_fused", False):
            return None
        return cls(module.weight, module.variance_epsilon)


@dataclass(frozen=True, slots=True)
class _Layer:
    index: int  # its KV pool layer
    input_norm: _Norm
    qkv: Q4Linear  # [q | k | v] in one GEMM
    q_width: int
    k_width: int
    q_norm: _Norm | None  # Qwen3's per-head norms
    k_norm: _Norm | None
    rotary_cos_sin: torch.Tensor
    scale: float
    sliding_window: int | None
    o_proj: Q4Linear
    post_norm: _Norm
    gate_up: Q4Linear
    down: Q4Linear


class DirectForward:
    def __init__(self, kernels, embed, layers: list[_Layer], norm: _Norm, head, head_dim: int):
        self.kernels = kernels
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.head = head
        self.head_dim = head_dim

    @classmethod
    def of(cls, model, kernels) -> DirectForward | None:
        """The direct forward of `model` (patched by fused_model.py with `kernels`, its
        decoder in Q4_1), or None when a part is not what this code runs."""
        try:
            direct = cls._read(model, kernels)
        except _NotDirect as refused:
            log.info("the model runs through transformers' modules: %s", refused)
            return None
        log.info("direct forward: %d layers on Pagoda's kernels", len(direct.layers))
        return direct

    @classmethod
    def _read(cls, model, kernels) -> DirectForward:
        text = model.config.get_text_config()
        if getattr(text, "model_type", None) not in ("llama", "qwen3"):
            raise _NotDirect(f"model type {getattr(text, 'model_type', None)}")
        decoder = getattr(model, "model", None)
        if decoder is None or not hasattr(decoder, "layers"):
            raise _NotDirect("no decoder stack at model.model.layers")
        if len(decoder.layers) != text.num_hidden_layers:
            raise _NotDirect("the stack's length is not num_hidden_layers")
        layers = [cls._read_layer(layer, kernels) for layer in decoder.layers]
        norm = _Norm.of(decoder.norm)
        if norm is None:
            raise _NotDirect("the final norm is not patched")
        return cls(
            kernels,
            model.get_input_embeddings(),
            layers,
            norm,
            model.get_output_embeddings(),
            decoder.layers[0].self_attn.head_dim,
        )

    @staticmethod
    def _read_layer(layer, kernels) -> _Layer:
        attention, mlp = layer.self_attn, layer.mlp
        if not all(getattr(m, "_pagoda_fused", False) for m in (layer, attention, mlp)):
            raise _NotDirect(f"layer {attention.layer_idx} is not patched whole")
        q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
        if not all(isinstance(s, Q4Slice) for s in (q, k, v)) or not (
            q.fused is k.fused is v.fused
            and (q.start, q.end, k.start, k.end, v.start) == (0, q.end, q.end, k.end, k.end)
            and v.end == q.fused.layer.out_features
        ):
            raise _NotDirect("q/k/v are not one Q4_1 GEMM")
        gemms = (q.fused.layer, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(g, Q4Linear) and g.runs_on(kernels) for g in gemms):
            raise _NotDirect("a projection is not on the Q4_1 kernel")
        norms = (_Norm.of(layer.input_layernorm), _Norm.of(layer.post_attention_layernorm))
        if None in norms:
            raise _NotDirect("a layer norm is not patched")
        qwen3 = hasattr(attention, "q_norm")
        q_norm = _Norm.of(attention.q_norm) if qwen3 else None
        k_norm = _Norm.of(attention.k_norm) if qwen3 else None
        if qwen3 and (q_norm is None or k_norm is None):
            raise _NotDirect("a q/k norm is not patched")
        return _Layer(
            index=attention.layer_idx,
            input_norm=norms[0],
            qkv=q.fused.layer,
            q_width=q.end - q.start,
            k_width=k.end - k.start,
            q_norm=q_norm,
            k_norm=k_norm,
            rotary_cos_sin=attention.rotary_cos_sin,
            scale=attention.scaling,
            sliding_window=getattr(attention, "sliding_window", None),
            o_proj=attention.o_proj,
            post_norm=norms[1],
            gate_up=mlp.gate_up_proj,
            down=mlp.down_proj,
        )

    def __call__(self, batch: RaggedBatch, pool: KVPool, backend: AttentionBackend) -> torch.Tensor:
        """The logits [rows sampled, vocabulary] of the step `batch`, its K/V written into
        `pool`: what `model(input_ids=..., logits_to_keep=...).logits[0]` gives."""
        kernels, head_dim = self.kernels, self.head_dim
        hidden = self.embed(batch.input_ids[0])  # [T, hidden]
        positions = batch.position_ids.reshape(-1)
        metadata = batch.attention
        num_tokens = hidden.shape[0]
        for layer in self.layers:
            x = kernels.rms_norm(hidden, layer.input_norm.weight, layer.input_norm.eps)
            qkv = layer.qkv.rows(x)
            q_end = layer.q_width
            k_end = q_end + layer.k_width
            query = qkv[:, :q_end].view(num_tokens, -1, head_dim)
            key = qkv[:, q_end:k_end].view(num_tokens, -1, head_dim)
            value = qkv[:, k_end:].view(num_tokens, -1, head_dim)
            if layer.q_norm is not None:
                query = kernels.rms_norm(query, layer.q_norm.weight, layer.q_norm.eps)
                key = kernels.rms_norm(key, layer.k_norm.weight, layer.k_norm.eps)
            kernels.rotary_in_place(query, key, positions, layer.rotary_cos_sin)
            attended = attend(
                backend,
                pool.layer_blocks(layer.index),
                query,
                key,
                value,
                metadata,
                scale=layer.scale,
                sliding_window=layer.sliding_window,
            )
            out = layer.o_proj.rows(attended.reshape(num_tokens, -1))
            x, residual = kernels.rms_norm(
                out, layer.post_norm.weight, layer.post_norm.eps, residual=hidden
            )
            hidden = residual + layer.down.rows(kernels.silu_and_mul(layer.gate_up.rows(x)))
        hidden = kernels.rms_norm(hidden, self.norm.weight, self.norm.eps)
        return self.head(hidden[batch.sample_token_indices])


class _NotDirect(Exception):
    pass
