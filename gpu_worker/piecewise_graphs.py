"""CUDA graphs for the steps a decode graph cannot take: the model's dense parts
captured per token bucket, each layer's attention run eagerly between them.

A step that feeds a prompt chunk (or more rows than the largest decode bucket, or a row
that does not sample) packs T tokens of ragged sequences: its attention launches a grid
that depends on the step's sequences, so the whole forward cannot be replayed. Everything
around the attention is row-wise (embedding, norms, projections, RoPE, MLP) and depends on
T alone. So the step is padded to the smallest token bucket >= T (`token_buckets`:
16 .. 256 doubling, then every 256 up to the worker's largest step), and the base model's
forward of that many tokens is captured in pieces, cut at every attention: L layers give
L + 1 graphs,

    [embedding .. layer 0's q/k/v], [layer 0's o_proj .. layer 1's q/k/v], ...,
    [layer L-1's o_proj .. final norm].

At the cut, a piece copies the layer's q/k/v into buffers that every layer and bucket
shares (one layer attends at a time), and the next piece reads the attention's output
from another. A step replays the pieces in order and, between two, the engine's own
backend writes the step's T real rows' K/V and attends over them with the step's
metadata; padded rows never reach the attention or the KV pool (their stale output rows
only flow through row-wise layers). The logits are then computed eagerly at the rows
that sample (one gather and the LM head's GEMM; only Llama and Qwen3, whose head is that
alone). A replay costs L + 1 graph launches and two or three kernels per layer, against
about 40 kernels per layer eagerly.

The cut is an attention backend (`_Cut`), passed to the model as the step's
`attention_backend`, so the model's code is not touched. Capture follows the decode
graphs', at load, under a budget of its own (60 s); a bucket not captured runs the
plain eager forward. `run_eager` runs the same padded forward through the same cut and
attention without capture: how the CPU tests check the bookkeeping (the capture and
replay need CUDA; `make gpu-check` compares replayed logits with eager ones).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagoda.gpu_worker.cuda_graphs import bucket_for
from pagoda.gpu_worker.fused_model import FUSED_MODEL_TYPES

if TYPE_CHECKING:
    from pagoda.gpu_worker.ragged_batch import RaggedBatch

log = logging.getLogger("pagoda.worker.cuda_graphs")

SMALL_TOKEN_BUCKETS = (16, 32, 64, 128, 256)
LARGE_BUCKET_STEP = 256


def token_buckets(max_num_tokens: int) -> tuple[int, ...]:
    """16, 32 .. 256, then every 256, up to the first bucket >= `max_num_tokens`."""
    buckets: list[int] = []
    bucket = 0
    for bucket in SMALL_TOKEN_BUCKETS:
        buckets.append(bucket)
        if bucket >= max_num_tokens:
            return tuple(buckets)
    while bucket < max_num_tokens:
        bucket += LARGE_BUCKET_STEP
        buckets.append(bucket)
    return tuple(buckets)


def refusal(model) -> str | None:
    """Why `model` cannot be captured in pieces (None: it can): its logits must be the LM
    head applied to the base model's last hidden states, nothing more."""
    model_type = getattr(model.config.get_text_config(), "model_type", None)
    if model_type not in FUSED_MODEL_TYPES:
        return f"model type {model_type} (only {', '.join(FUSED_MODEL_TYPES)})"
    if getattr(model, "lm_head", None) is None or model.base_model is model:
        return "no separate base model and LM head"
    return None


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer's attention needs besides q/k/v and the step's metadata, as the
    model passed it at the cut."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    scale: float
    sliding_window: int | None
    softcap: float | None

    def same_as(self, other: LayerAttention) -> bool:
        return (
            self.key_cache is other.key_cache
            and self.value_cache is other.value_cache
            and (self.scale, self.sliding_window, self.softcap)
            == (other.scale, other.sliding_window, other.softcap)
        )


class PiecewiseGraphs:
    """The piecewise-captured forwards of one engine, one list of graphs per bucket."""

    def __init__(self, engine, buckets: tuple[int, ...]) -> None:
        self._engine = engine
        self.buckets = tuple(sorted(buckets))
        self._graphs: dict[int, list] = {}  # bucket -> [torch.cuda.CUDAGraph] * (L + 1)
        self._hidden: dict[int, torch.Tensor] = {}  # bucket -> [1, bucket, hidden] it writes
        self.layers: list[LayerAttention] = []  # recorded by the first forward
        device = engine.device
        largest = self.buckets[-1]
        self._input_ids = torch.zeros(1, largest, dtype=torch.long, device=device)
        self._positions = torch.zeros(1, largest, dtype=torch.long, device=device)
        # q/k/v and the attention's output [largest, heads, head_dim]: sized at the first cut.
        self._query = self._key = self._value = self._output = None
        self._cut = _Cut(self)
        self._pool = None

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def bucket_for(self, num_tokens: int) -> int | None:
        return bucket_for(num_tokens, self.buckets)

    def fits(self, batch: RaggedBatch) -> bool:
        """A packed step whose token bucket was captured."""
        return self.bucket_for(batch.num_tokens) in self._graphs

    def capture(self, budget_s: float) -> None:
        """Capture the buckets, largest first (later ones reuse its memory pool), until
        `budget_s` runs out; the rest run eagerly."""
        started_s = time.monotonic()
        self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bucket in reversed(self.buckets):
                if time.monotonic() - started_s > budget_s:
                    log.warning(
                        "piecewise capture stopped after %.1f s with %d of %d token buckets: "
                        "steps of the smaller sizes run eagerly",
                        time.monotonic() - started_s,
                        len(self._graphs),
                        len(self.buckets),
                    )
                    break
                self._capture_one(bucket)
        log.info(
            "captured %d token buckets in pieces (%s tokens, %d graphs each) in %.1f s",
            len(self._graphs),
            ", ".join(map(str, self.captured_buckets)),
            len(self.layers) + 1,
            time.monotonic() - started_s,
        )

    def _capture_one(self, bucket: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # JIT and autotuning outside the capture; no attention runs
                self._forward(bucket, _Mode.WARM)
            torch.cuda.synchronize()
            self._cut.pieces = [torch.cuda.CUDAGraph()]
            self._cut.pieces[0].capture_begin(pool=self._pool)
            try:
                hidden = self._forward(bucket, _Mode.CAPTURE)
            except BaseException:
                self._end_open_capture()
                raise
            self._cut.pieces[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        pieces, self._cut.pieces = self._cut.pieces, []
        if len(pieces) != len(self.layers) + 1:
            raise RuntimeError(f"{len(pieces)} pieces for {len(self.layers)} attention layers")
        self._graphs[bucket] = pieces
        self._hidden[bucket] = hidden  # kept: the last piece writes there at every replay

    def _end_open_capture(self) -> None:
        """After a failure inside a capture, end it, as torch.cuda.graph does on its way
        out: a stream left capturing would refuse the device's next work (the error that
        ended it, if any, is the one raised)."""
        self._cut.pieces, pieces = [], self._cut.pieces
        if pieces and torch.cuda.is_current_stream_capturing():
            try:
                pieces[-1].capture_end()
            except RuntimeError:
                pass

    def run(self, batch: RaggedBatch) -> torch.Tensor:
        """The logits of a step that `fits` at the rows that sample, in plan order."""
        num_tokens = batch.num_tokens
        bucket = self.bucket_for(num_tokens)
        self._stage(batch)
        for index, piece in enumerate(self._graphs[bucket]):
            piece.replay()
            if index < len(self.layers):
                self.attend(index, num_tokens, batch.attention)
        return self._logits(self._hidden[bucket], batch)

    def run_eager(self, batch: RaggedBatch) -> torch.Tensor:
        """`run` without graphs: the same padded forward, cut and attention, in one pass
        (each layer attends at its cut)."""
        self._stage(batch)
        bucket = self.bucket_for(batch.num_tokens)
        self._cut.step = batch
        try:
            hidden = self._forward(bucket, _Mode.EAGER)
        finally:
            self._cut.step = None
        return self._logits(hidden, batch)

    def attend(self, index: int, num_tokens: int, metadata) -> None:
        """Layer `index`'s attention over the step's `num_tokens` real rows of the shared
        q/k/v, into the shared output, with the engine's backend: as the model calls it
        (paged_attention.py), K/V written first."""
        layer = self.layers[index]
        backend = self._engine.attention_backend
        key, value = self._key[:num_tokens], self._value[:num_tokens]
        backend.write_kv(key, value, layer.key_cache, layer.value_cache, metadata)
        output = backend.forward(
            self._query[:num_tokens],
            key,
            value,
            layer.key_cache,
            layer.value_cache,
            metadata,
            scale=layer.scale,
            sliding_window=layer.sliding_window,
            softcap=layer.softcap,
        )
        self._output[:num_tokens].copy_(output)

    def _stage(self, batch: RaggedBatch) -> None:
        """The step's token ids and positions into the static inputs (device to device;
        the padded rows keep what an earlier step left: valid ids and positions)."""
        num_tokens = batch.num_tokens
        self._input_ids[:, :num_tokens].copy_(batch.input_ids)
        self._positions[:, :num_tokens].copy_(batch.position_ids)

    def _forward(self, bucket: int, mode: _Mode) -> torch.Tensor:
        """The base model over the first `bucket` static inputs, cut at every attention."""
        engine = self._engine
        self._cut.start(mode)
        hidden = engine.model.base_model(
            input_ids=self._input_ids[:, :bucket],
            position_ids=self._positions[:, :bucket],
            use_cache=False,
            # The cut reads no metadata: the step's reaches it through `attend`.
            attention_metadata=_NO_METADATA,
            kv_pool=engine.pool,
            attention_backend=self._cut,
        ).last_hidden_state
        self._cut.finish()
        return hidden

    def _logits(self, hidden: torch.Tensor, batch: RaggedBatch) -> torch.Tensor:
        rows = hidden[0].index_select(0, batch.sample_token_indices)
        return self._engine.model.lm_head(rows)

    def _at_cut(self, query, key, value, layer: LayerAttention) -> torch.Tensor:
        """Called by the cut at each layer's attention, in forward order."""
        num_rows = query.shape[0]
        if self._query is None:  # the first forward, eager: outside any capture
            largest = self.buckets[-1]
            self._query = query.new_zeros(largest, *query.shape[1:])
            self._output = query.new_zeros(largest, *query.shape[1:])
            self._key = key.new_zeros(largest, *key.shape[1:])
            self._value = value.new_zeros(largest, *value.shape[1:])
        if query.shape[1:] != self._query.shape[1:] or key.shape[1:] != self._key.shape[1:]:
            raise RuntimeError("piecewise graphs need every layer's q/k/v of one shape")
        self._query[:num_rows].copy_(query)
        self._key[:num_rows].copy_(key)
        self._value[:num_rows].copy_(value)
        return self._output[:num_rows]


class _Mode:
    WARM = "warm"  # compile the dense kernels: no attention (output rows stay as they are)
    CAPTURE = "capture"  # end the current piece's graph at each cut and begin the next
    EAGER = "eager"  # attend at each cut (run_eager)


_NO_METADATA = object()


class _Cut:
    """The attention backend a piecewise forward passes to the model: hands each layer's
    q/k/v to PiecewiseGraphs._at_cut and returns the shared output for the next piece."""

    name = "piecewise-cut"

    def __init__(self, graphs: PiecewiseGraphs) -> None:
        self._graphs = graphs
        self.pieces: list = []  # while capturing: the graphs so far, the last one open
        self.step: RaggedBatch | None = None  # EAGER: the step whose rows attend
        self._mode = _Mode.WARM
        self._index = 0

    def start(self, mode: str) -> None:
        self._mode, self._index = mode, 0

    def finish(self) -> None:
        layers = self._graphs.layers
        if self._index != len(layers):
            raise RuntimeError(f"{self._index} attention calls after {len(layers)} before")

    def write_kv(self, key, value, key_cache, value_cache, metadata) -> None:
        """Nothing: forward() gets the same key and value, and hands them on."""

    def forward(
        self,
        query,
        key,
        value,
        key_cache,
        value_cache,
        metadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        graphs, index = self._graphs, self._index
        self._index += 1
        layer = LayerAttention(key_cache, value_cache, scale, sliding_window, softcap)
        if index == len(graphs.layers):
            graphs.layers.append(layer)
        elif not graphs.layers[index].same_as(layer):
            raise RuntimeError(f"attention layer {index} changed between forwards")
        output = graphs._at_cut(query, key, value, layer)
        if self._mode == _Mode.CAPTURE:
            self.pieces[-1].capture_end()
            self.pieces.append(torch.cuda.CUDAGraph())
            self.pieces[-1].capture_begin(pool=graphs._pool)
        elif self._mode == _Mode.EAGER:
            step = self.step
            graphs.attend(index, step.num_tokens, step.attention)
        return output
