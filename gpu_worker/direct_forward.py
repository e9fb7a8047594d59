"""The CPU fast path's forward without transformers' module calls.

On the CPU under `int8` a Llama or Qwen3 model runs on Pagoda's kernels alone: the
decoder's Linear layers as Q4_1 GEMMs (quantization.py; q/k/v and gate/up one call each),
the norms, SiLU*up and RoPE on elementwise.c (fused_model.py), the attention on the `cpu`
backend's kernel (the engine builds this only with it), the head rescored. What
transformers' code still adds is glue: a dozen module calls a layer, keyword arguments
handed down to each, position embeddings and a mask it builds and never reads. At one row
that glue was a third of a decode step (3.2 of 9.7 ms on two Zen 5 cores).

`DirectForward.of(model, kernels)` reads those parts off a model patched that way; a step
then runs the whole decoder stack in one call of decoder.c, the same kernels in the same
order on the same values as the model's code, so its logits are the model call's, bit for
bit (tests/worker/test_direct_forward.py). One call where the stack took about ten a layer
from Python: each ctypes call and OpenMP wake-up cost 3-4 us and more, 1.6 of a 5.3 ms
decode step at batch 1 (5.24-5.43 -> 3.59-3.74 ms). It returns None, with the reason
logged, when a part is not what it expects, and the engine then calls the model.
`--no-fused-ops` leaves the model unpatched, so it turns this off too.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from pagoda.gpu_worker import cpu_kernels
from pagoda.gpu_worker.kv_pool import KVPool
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
    def __init__(self, kernels, embed, layers: list[_Layer], norm: _Norm, head, shape):
        self.kernels = kernels
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.head = head
        self._shape = shape  # cpu_kernels.DecoderShape
        self._pool: KVPool | None = None  # the pool _layer_args points into
        self._layer_args: ctypes.Array | None = None

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
        attention = decoder.layers[0].self_attn
        head_dim = attention.head_dim
        if head_dim % 8:
            raise _NotDirect(f"head_dim {head_dim} is not a multiple of 8 (the attention's)")
        shape = cpu_kernels.DecoderShape(
            text.hidden_size,
            layers[0].q_width // head_dim,
            layers[0].k_width // head_dim,
            head_dim,
            layers[0].gate_up.out_features // 2,
            0,  # the pool's block size: set with its caches (_layers_in)
        )
        return cls(
            kernels,
            model.get_input_embeddings(),
            layers,
            norm,
            model.get_output_embeddings(),
            shape,
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

    def __call__(self, batch: RaggedBatch, pool: KVPool) -> torch.Tensor:
        """The logits [rows sampled, vocabulary] of the step `batch`, its K/V written into
        `pool` (float32, as the engine makes it on the CPU): what
        `model(input_ids=..., logits_to_keep=...).logits[0]` gives."""
        kernels = self.kernels
        hidden = self.embed(batch.input_ids[0]).contiguous()  # [T, hidden], a new tensor
        metadata = batch.attention
        positions = batch.position_ids.reshape(-1).to(torch.int64).contiguous()
        slots = metadata.slot_mapping.contiguous()
        table = metadata.block_table.contiguous()
        starts = metadata.query_start_loc.contiguous()
        context_lens = metadata.context_lens.contiguous()
        step = cpu_kernels.DecoderStep(
            hidden.shape[0],
            context_lens.shape[0],
            metadata.max_context_len,
            table.shape[1],
            positions.data_ptr(),
            slots.data_ptr(),
            table.data_ptr(),
            starts.data_ptr(),
            context_lens.data_ptr(),
        )
        kernels.decoder_layers(self._layers_in(pool), self._shape, step, hidden)
        hidden = kernels.rms_norm(hidden, self.norm.weight, self.norm.eps)
        return self.head(hidden[batch.sample_token_indices])

    def _layers_in(self, pool: KVPool) -> ctypes.Array:
        """The layers as decoder.c reads them, with `pool`'s caches (built once a pool)."""
        if self._pool is not pool:
            self._layer_args = (cpu_kernels.DecoderLayer * len(self.layers))(
                *(_layer_args(layer, pool) for layer in self.layers)
            )
            self._shape.block_size = pool.layer_blocks(0)[0].shape[1]
            self._pool = pool
        return self._layer_args


def _layer_args(layer: _Layer, pool: KVPool) -> cpu_kernels.DecoderLayer:
    key_cache, value_cache = pool.layer_blocks(layer.index)
    for cache in (key_cache, value_cache):
        if cache.dtype != torch.float32 or not cache.is_contiguous():
            raise RuntimeError("the direct forward needs a contiguous float32 KV pool")
    q_norm, k_norm = layer.q_norm, layer.k_norm
    return cpu_kernels.DecoderLayer(
        layer.input_norm.weight.data_ptr(),
        layer.post_norm.weight.data_ptr(),
        None if q_norm is None else q_norm.weight.data_ptr(),
        None if k_norm is None else k_norm.weight.data_ptr(),
        layer.input_norm.eps,
        layer.post_norm.eps,
        0.0 if q_norm is None else q_norm.eps,
        0.0 if k_norm is None else k_norm.eps,
        *(
            cpu_kernels.Q4Weight.of(g.packed, g.bias)
            for g in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        ),
        layer.rotary_cos_sin.data_ptr(),
        layer.scale,
        layer.sliding_window or 0,
        key_cache.data_ptr(),
        value_cache.data_ptr(),
    )


class _NotDirect(Exception):
    pass
