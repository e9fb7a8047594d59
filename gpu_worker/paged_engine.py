"""The paged engine: one forward per step over a ragged batch, then batched sampling.

Wraps an unmodified `transformers` causal LM whose attention implementation is
switched to pagoda.gpu_worker.paged_attention; logits are computed only at the rows that
sample (the model's own `logits_to_keep`, so architecture-specific logit scaling
or soft-capping still applies).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagoda.common.step import StepPlan, has_penalty
from pagoda.gpu_worker import paged_attention
from pagoda.gpu_worker.attention import create_backend
from pagoda.gpu_worker.block_tables import BlockTables
from pagoda.gpu_worker.config import WorkerConfig, resolves_launch_ahead
from pagoda.gpu_worker.cuda_graphs import CAPTURE_BUDGET_S, DecodeGraphs, can_capture
from pagoda.gpu_worker.direct_forward import DirectForward
from pagoda.gpu_worker.engine import (
    ComputedTokens,
    Engine,
    EngineFacts,
    PendingTokens,
    SampledTokens,
)
from pagoda.gpu_worker.kv_pool import GIB, KVGeometry, KVPool, num_blocks_for_budget
from pagoda.gpu_worker.kv_sizing import kv_budget_bytes, measure_memory, profile_plan
from pagoda.gpu_worker.model_loader import load_model, resolve_model_dir
from pagoda.gpu_worker.numerics import describe_numerics, make_batch_invariant
from pagoda.gpu_worker.piecewise_graphs import PiecewiseGraphs, refusal, token_buckets
from pagoda.gpu_worker.quantization import quantize, resolve_quantization
from pagoda.gpu_worker.ragged_batch import build_ragged_batch, packed_rows
from pagoda.gpu_worker.sampler import DeviceSample, SampleRow, sample_on_device
from pagoda.gpu_worker.sequence_table import PENDING_TOKEN
from pagoda.gpu_worker.step_events import DeviceEvent, StepClock, upload
from pagoda.gpu_worker.token_counts import TokenCounts
from pagoda.gpu_worker.warm_up import warm_up

if TYPE_CHECKING:
    from pagoda.gpu_worker.tensor_parallel import GroupSampling

log = logging.getLogger("pagoda.worker.engine")


def eos_token_ids_of(model) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (model.config.get_text_config(), getattr(model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def max_positions_of(model) -> int:
    text = model.config.get_text_config()
    return int(getattr(text, "max_position_embeddings", None) or 2048)


class PagedEngine(Engine):
    """Executes step plans on one model and one KV pool. Called only from the step loop.

    On a tensor-parallel rank `group_sampling` (set by tensor_parallel.join_engine) runs
    each step's forward and says who samples: rank 0 alone, which shares its tokens.
    """

    def __init__(
        self,
        model,
        *,
        model_id: str,
        num_kv_blocks: int,
        block_size: int = 16,
        max_context_tokens: int | None = None,
        fail_on_token_id: int | None = None,
        quantization: str = "none",  # "int8": see pagoda.gpu_worker.quantization
        attention_backend: str = "reference",  # see pagoda.gpu_worker.attention
        cuda_graphs: bool = False,  # see pagoda.gpu_worker.cuda_graphs
        # With cuda_graphs, the largest step captured in pieces (piecewise_graphs.py); 0: none.
        piecewise_tokens: int = 0,
        fused_ops: bool = True,  # see pagoda.gpu_worker.fused_model and _fuse_dense_ops
    ) -> None:
        quantize(model, quantization)
        if next(model.parameters()).device.type == "cpu":
            make_batch_invariant(model)  # the float Linear layers (numerics.py)
        numerics = describe_numerics(model, quantization)
        paged_attention.register()
        model.set_attn_implementation(paged_attention.ATTENTION_NAME)
        paged_attention.number_attention_layers(model)
        self.model = model
        parameter = next(model.parameters())
        self.device = parameter.device
        if self.device.type == "cuda":
            # cuDNN attention builds and caches a plan per new shape (every step's context
            # length is new): tens of ms each, and host memory that is never given back.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.attention_backend = create_backend(attention_backend, self.device.type, block_size)
        kernel = getattr(self.attention_backend, "uses_kernel", False)
        numerics += f"; attention backend: {self.attention_backend.name}" + (
            " (Pagoda's float32 kernel, keys summed in position order)" if kernel else ""
        )
        max_context_tokens = max_context_tokens or max_positions_of(model)
        self.direct: DirectForward | None = None  # the CPU fast path's (direct_forward.py)
        if fused_ops:
            numerics += self._fuse_dense_ops(model, quantization, max_context_tokens)
        geometry = KVGeometry.from_model_config(model.config, block_size, parameter.dtype)
        graphs = cuda_graphs and can_capture(self.attention_backend.name, self.device.type)
        # With graphs, one block more than announced: padded rows' scratch (cuda_graphs.py).
        self.pool = KVPool(geometry, num_kv_blocks + graphs, self.device)
        self.block_size = block_size
        facts = EngineFacts(
            model_id=model_id,
            vocab_size=model.get_output_embeddings().out_features,
            eos_token_ids=eos_token_ids_of(model),
            max_context_tokens=max_context_tokens,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            device=str(self.device),
            dtype=str(parameter.dtype).removeprefix("torch."),
            quantization=quantization,
            numerics=numerics,
            batch_invariant=self.device.type == "cpu",  # describe_numerics says why
        )
        super().__init__(facts, fail_on_token_id=fail_on_token_id)
        self.token_counts = TokenCounts(facts.vocab_size, self.device)  # for penalties
        max_blocks_per_seq = -(-facts.max_context_tokens // block_size)
        self.block_tables = BlockTables(max_blocks_per_seq, self.device)
        self.decode_graphs: DecodeGraphs | None = None
        self.group_sampling: GroupSampling | None = None  # one device: None
        self.piecewise_graphs: PiecewiseGraphs | None = None
        if graphs:  # captured by load_engine, before the hello
            self.decode_graphs = DecodeGraphs(self, scratch_block=num_kv_blocks)
            refused = refusal(model) if piecewise_tokens else "not asked for"
            if refused is None:
                self.piecewise_graphs = PiecewiseGraphs(self, token_buckets(piecewise_tokens))
            else:
                log.info("no piecewise graphs: %s", refused)

    def _fuse_dense_ops(self, model, quantization: str, max_context_tokens: int) -> str:
        """Patch the fused RMSNorm (with its residual add), SiLU*up and RoPE in where they
        run (fused_model.py): on CUDA with the triton backend, Triton's; on the CPU under
        `int8` with Pagoda's kernels loaded, elementwise.c's (`none` stays PyTorch's code,
        the reference). Returns what to add to the numerics line."""
        from pagoda.gpu_worker import fused_model

        if self.device.type == "cuda" and self.attention_backend.name == "triton":
            fused_model.fuse_model(model, max_context_tokens)  # logs what it fused
            return ""
        if (
            self.device.type != "cpu"
            or quantization != "int8"
            or not getattr(self.attention_backend, "uses_kernel", False)
            or not fused_model.cpu_fusable(model)
        ):
            return ""
        from pagoda.gpu_worker import cpu_kernels

        kernels = cpu_kernels.load()
        counts = fused_model.fuse_model(model, max_context_tokens, kernels)
        if not counts.total:
            return ""
        self.direct = DirectForward.of(model, kernels)
        return "; RMSNorm, SiLU*up and RoPE: Pagoda's float32 kernels"

    def compute(self, plan: StepPlan) -> SampledTokens:
        return self.launch_compute(plan).read()

    def launch_compute(self, plan: StepPlan) -> PendingTokens:
        if self.group_sampling is None:
            return self._launch_forward(plan, samples=True, fill=self._pending_fill(plan))
        return ComputedTokens(self.group_sampling.compute(plan, self.forward_and_sample))

    def can_launch_ahead(self, plan: StepPlan) -> bool:
        """Also not on a tensor-parallel rank, nor under the fault hook (it reads fed
        tokens on the host)."""
        return (
            super().can_launch_ahead(plan)
            and self.group_sampling is None
            and self.fail_on_token_id is None
        )

    def _pending_fill(self, plan: StepPlan) -> TokenFill | None:
        """Where the admitted `plan` feeds PENDING_TOKEN, the unread step's sampled tokens
        to put there on the device; None when it feeds none."""
        unread = self._unread
        if unread is None or unread.sampling is None:
            return None
        token_ids, offsets = plan.token_ids, plan.token_offsets
        rows = [i for i in range(len(plan.seq_ids)) if token_ids[offsets[i]] == PENDING_TOKEN]
        if not rows:
            return None
        sample_row_of = {seq.seq_id: k for k, seq in enumerate(unread.sampling.sequences)}
        seq_ids = plan.seq_ids
        return TokenFill(
            rows, [sample_row_of[seq_ids[i]] for i in rows], unread.tokens.device_token_ids
        )

    @torch.inference_mode()
    def forward_and_sample(self, plan: StepPlan, *, samples: bool) -> SampledTokens:
        """The forward over the admitted `plan`, then its sampling when `samples` (else no
        token ids)."""
        return self._launch_forward(plan, samples=samples, fill=None).read()

    @torch.inference_mode()
    def _launch_forward(
        self, plan: StepPlan, *, samples: bool, fill: TokenFill | None
    ) -> EnqueuedTokens:
        """Enqueue the forward over the admitted `plan` (its PENDING_TOKEN rows fed by
        `fill`) and, when `samples`, its sampling; nothing here waits for the device but
        a plan whose masks follow (sampling_rows)."""
        clock = StepClock(self.device)
        self.token_counts.update(plan, self.table, fill)
        graphs = self.decode_graphs
        if graphs is not None and graphs.fits(plan):
            return self._sample(graphs.run(plan, fill), plan, clock, samples)
        rows_of = self.block_tables.update(plan, self.table)
        batch = build_ragged_batch(
            plan, self.table, self.block_size, self.device, (self.block_tables.table, rows_of)
        )
        if fill is not None:
            fill.apply(batch.input_ids[0], packed_rows(plan, fill.rows))
        pieces = self.piecewise_graphs
        if pieces is not None and pieces.fits(batch):
            return self._sample(pieces.run(batch), plan, clock, samples)
        if self.direct is not None:
            return self._sample(self.direct(batch, self.pool), plan, clock, samples)
        logits = self.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            logits_to_keep=batch.sample_token_indices,
            use_cache=False,
            # Reach every layer's paged_attention_forward as keyword arguments.
            attention_metadata=batch.attention,
            kv_pool=self.pool,
            attention_backend=self.attention_backend,
        ).logits[0]
        return self._sample(logits, plan, clock, samples)

    def _sample(
        self,
        logits: torch.Tensor,
        plan: StepPlan,
        clock: StepClock,
        samples: bool,
    ) -> EnqueuedTokens:
        """Enqueue the sampling of `logits`'s rows (one per sample point of the admitted
        `plan`, in order: SequenceTable.sampling_rows). The host does not wait for the
        forward: it waits once, when the tokens are read (step_events.py)."""
        clock.forward_enqueued()
        if not samples:  # another rank samples (tensor parallel): no masks to wait for
            return EnqueuedTokens(clock, None)
        sampling = self.sampling_rows(plan)  # waits for masks that follow the plan
        sequences, masks = sampling.sequences, sampling.masks
        rows = [
            SampleRow(
                seq.sampling,
                seq.token_ids,
                seq.num_prompt_tokens,
                position,
                masks.get(point),
                seq.min_new_tokens,
                seq.min_tokens_banned_ids,
            )
            for point, (seq, position) in enumerate(zip(sequences, sampling.positions, strict=True))
        ]
        counts = None
        if any(has_penalty(seq.sampling) for seq in sequences):
            token_counts = self.token_counts
            counts = token_counts.gather(
                [token_counts.row_of(seq) for seq in sequences],
                with_counts=any(
                    seq.sampling.presence_penalty or seq.sampling.frequency_penalty
                    for seq in sequences
                ),
            )
            if sampling.drafted_seq_ids:
                token_counts.add_drafts(*counts, sampling)
        return EnqueuedTokens(clock, sample_on_device(logits, rows, counts) if rows else None)


@dataclass(slots=True)
class EnqueuedTokens:
    """The paged engine's PendingTokens: a step's sampling (None: it samples nothing),
    enqueued behind its forward, and the step's clock."""

    clock: StepClock
    sample: DeviceSample | None
    # A step that samples nothing waits on this, recorded after its last copy: the step
    # after the next reuses pinned staging that its copies may still read.
    finished: DeviceEvent | None = None

    def __post_init__(self) -> None:
        if self.sample is None:
            self.finished = DeviceEvent(self.clock.device).record()

    @property
    def device_token_ids(self) -> torch.Tensor | None:
        return None if self.sample is None else self.sample.token_ids

    def done(self) -> bool:
        return self.sample.done() if self.sample is not None else self.finished.query()

    def read(self) -> SampledTokens:
        if self.sample is None:
            self.finished.synchronize()
            return SampledTokens([], forward_ms=sum(self.clock.timings_ms()))
        output = self.sample.read()
        forward_ms, sample_ms = self.clock.timings_ms()
        return SampledTokens(
            token_ids=output.token_ids,
            logprobs=output.logprobs,
            top_token_ids=output.top_token_ids,
            top_logprobs=output.top_logprobs,
            forward_ms=forward_ms,
            sample_ms=sample_ms,
        )


@dataclass(slots=True)
class TokenFill:
    """A step launched ahead feeds, at plan row rows[k] (one token each), the token that
    the unread step sampled at its sampling row sources[k], from `tokens` on the device."""

    rows: list[int]
    sources: list[int]
    tokens: torch.Tensor  # [S] int64, the unread step's DeviceSample.token_ids

    def apply(self, input_ids: torch.Tensor, positions: list[int]) -> None:
        """input_ids[positions[k]] = tokens[sources[k]], in stream order (after the copies
        that wrote input_ids, before the forward that reads it)."""
        _, index = upload([*positions, *self.sources], torch.long, input_ids.device)
        n = len(positions)
        input_ids.index_copy_(0, index[:n], self.tokens.index_select(0, index[n:]))


def pick_device(requested: str) -> str:
    if requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_engine(config: WorkerConfig) -> PagedEngine:
    """Load the model named by the config, size the KV pool, build the engine; logs both."""
    from transformers.utils import logging as transformers_logging

    from pagoda.gpu_worker import tensor_parallel

    transformers_logging.disable_progress_bar()  # one log line per event, no bars
    # transformers prints through a handler of its own; through the root's instead, its
    # lines take the worker's --log-format (pagoda.common.logs).
    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    device = pick_device(config.device)
    quantization = resolve_quantization(config.quantization, device, config.dtype)
    started_s = time.monotonic()
    resolved = resolve_model_dir(config.model)
    model = load_model(resolved, device, config.dtype)
    log.info(
        "loaded %s on %s (%s) in %.1f s",
        resolved.model_id,
        device,
        str(model.dtype).removeprefix("torch."),
        time.monotonic() - started_s,
    )
    geometry = KVGeometry.from_model_config(model.config, config.block_size, model.dtype)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif device.startswith("cuda"):
        # After a profiling step as large as the scheduler's largest (kv_sizing.py).
        plan = profile_plan(
            config.max_num_batched_tokens,
            config.max_context_tokens or max_positions_of(model),
            config.block_size,
        )

        def probe(num_kv_blocks: int) -> PagedEngine:
            return PagedEngine(
                model,
                model_id=resolved.model_id,
                num_kv_blocks=num_kv_blocks,
                block_size=config.block_size,
                max_context_tokens=config.max_context_tokens,
                quantization=quantization,
                attention_backend=config.attention_backend,
            )

        profile = measure_memory(probe, plan, torch.device(device))
        log.info(
            "profiling step of %d tokens: peak %.3f GiB allocated (probe pool %.3f GiB), "
            "%.3f GiB used outside torch, %.3f GiB total",
            config.max_num_batched_tokens,
            profile.peak_allocated_bytes / GIB,
            profile.probe_pool_bytes / GIB,
            (profile.in_use_bytes - profile.reserved_bytes) / GIB,
            profile.total_bytes / GIB,
        )
        budget_bytes = kv_budget_bytes(profile, config.gpu_memory_utilization)
        num_blocks = num_blocks_for_budget(budget_bytes, geometry)
    else:
        num_blocks = num_blocks_for_budget(config.kv_cache_gib * GIB, geometry)
    num_blocks = tensor_parallel.agree_num_kv_blocks(num_blocks)  # identity without a group
    built_s = time.monotonic()
    engine = PagedEngine(
        model,
        model_id=resolved.model_id,
        num_kv_blocks=num_blocks,
        block_size=config.block_size,
        max_context_tokens=config.max_context_tokens,
        fail_on_token_id=config.fail_on_token_id,
        quantization=quantization,
        attention_backend=config.attention_backend,
        # Not across tensor-parallel ranks: their collectives are not captured here.
        cuda_graphs=config.cuda_graphs and config.tensor_parallel_size == 1,
        piecewise_tokens=config.max_num_batched_tokens if config.piecewise_graphs else 0,
        fused_ops=config.fused_ops,
    )
    log.info("attention backend %s", engine.attention_backend.name)
    if engine.decode_graphs is not None:
        # Not retried eagerly on failure: a failed capture can leave the CUDA context unusable.
        try:
            engine.decode_graphs.capture()  # before the hello: no step waits on it
        except Exception:
            log.error(
                "CUDA graph capture failed; --no-cuda-graphs "
                "(PAGODA_WORKER_CUDA_GRAPHS=false) runs the worker without graphs"
            )
            raise
    elif config.cuda_graphs and device.startswith("cuda"):
        log.info("no CUDA graphs: the %s backend loops on the host", engine.attention_backend.name)
    if engine.piecewise_graphs is not None:
        try:
            engine.piecewise_graphs.capture(CAPTURE_BUDGET_S)
        except Exception:
            # The capture was ended (PiecewiseGraphs._end_open_capture): the worker goes on
            # with the decode graphs; a device it left unusable fails the synchronize below.
            log.exception(
                "piecewise CUDA graph capture failed: steps with prompt chunks run eagerly "
                "(--no-piecewise-graphs, PAGODA_WORKER_PIECEWISE_GRAPHS=false, skips it)"
            )
            engine.piecewise_graphs = None
            torch.cuda.synchronize()
    # After the capture, which compiled the decode variants of its buckets already.
    warm_up(engine, max_num_seqs=config.max_num_batched_tokens)
    engine.launches_ahead = config.tensor_parallel_size == 1 and resolves_launch_ahead(
        config.launch_ahead, device
    )
    log.info(
        "quantization %s; steps launched ahead: %s; engine built in %.1f s",
        quantization,
        "yes" if engine.launches_ahead else "no",
        time.monotonic() - built_s,
    )
    log.info(
        "KV pool: %d blocks x %d tokens = %d tokens, %.3f GiB (%d layers, %d KV heads x %d)",
        num_blocks,
        config.block_size,
        num_blocks * config.block_size,
        engine.pool.num_bytes / GIB,
        geometry.num_layers,
        geometry.num_kv_heads,
        geometry.head_dim,
    )
    return engine
