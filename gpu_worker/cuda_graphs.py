"""CUDA graphs for decode-only steps: one captured forward per padded batch size.

A decode step of n sequences (every plan row feeds one token) is padded to the smallest
bucket B >= n of DECODE_BUCKETS (1, 2, 4, 8, then every 8 up to 256) and replayed from
the graph captured for B, so its ~1,300 kernel launches cost one. Padded rows feed
token 0 at position 0 into the scratch slot (the first slot of a block the engine keeps
outside the pool it announces, so no sequence's K/V is touched), read that slot alone
(context length 1), and their logits are never read. Steps that feed a prompt chunk, or
more sequences than the largest bucket, run eagerly as before.

What a graph replays is fixed at capture: the buffers below are static and each step
copies its (padded) inputs into them; the block table is max_blocks_per_seq wide, so
any context up to the model's limit fits. Its rows are gathered on the device from the
engine's BlockTables (one row number per sequence crosses from the host, not its whole
table), and a padded row's first column is set to the scratch block. Only backends without host-side loops can be
captured (the Triton one: the reference backend reads *_cpu tensors and loops on the
host); the engine asks `can_capture(backend)`.

Capture happens at load, before the worker says hello, so no step of the scheduler's
waits on it; it is bounded by CAPTURE_BUDGET_S (buckets left over run eagerly) and
logged. The bucketing and padding are plain Python (tested on the CPU); the capture and
replay need CUDA and are untested without it.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger("pagoda.worker.cuda_graphs")

DECODE_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, *range(16, 257, 8))
# Capture stops after this much wall time; the buckets not captured run eagerly.
CAPTURE_BUDGET_S = 60.0
PAD_TOKEN_ID = 0


def bucket_for(num_seqs: int, buckets: Sequence[int] = DECODE_BUCKETS) -> int | None:
    """The smallest bucket holding `num_seqs` rows (buckets ascending); None past the last."""
    if num_seqs < 1:
        return None
    index = bisect.bisect_left(buckets, num_seqs)
    return buckets[index] if index < len(buckets) else None


@dataclass(slots=True)
class PaddedDecode:
    """A decode step's inputs padded to `bucket` rows, flat, ready for the static buffers.
    Rows [0, num_seqs) are the step's sequences in plan order, the rest padding."""

    bucket: int
    num_seqs: int
    input_ids: list[int]  # [bucket]
    positions: list[int]  # [bucket]
    slot_mapping: list[int]  # [bucket]: where each row's K/V is written
    context_lens: list[int]  # [bucket]: keys each row reads, its own included


def pad_decode(
    token_ids: Sequence[int],
    positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    block_size: int,
    bucket: int,
    width: int,
    scratch_block: int,
) -> PaddedDecode:
    """Row i feeds token_ids[i] at positions[i] through block_tables[i]; pad to `bucket`
    rows of a `width`-wide block table. A padded row writes and reads the scratch slot
    only (its block table's first column is the scratch block: DecodeGraphs sets it)."""
    num_seqs = len(token_ids)
    if not 0 < num_seqs <= bucket:
        raise ValueError(f"{num_seqs} rows do not fit a bucket of {bucket}")
    slot_mapping: list[int] = []
    for position, blocks in zip(positions, block_tables, strict=True):
        block_index = position // block_size
        if block_index >= width or block_index >= len(blocks):
            raise ValueError(f"position {position} is not covered by the block table")
        slot_mapping.append(blocks[block_index] * block_size + position % block_size)
    num_padded = bucket - num_seqs
    scratch_slot = scratch_block * block_size
    return PaddedDecode(
        bucket=bucket,
        num_seqs=num_seqs,
        input_ids=[*token_ids, *[PAD_TOKEN_ID] * num_padded],
        positions=[*positions, *[0] * num_padded],
        slot_mapping=slot_mapping + [scratch_slot] * num_padded,
        context_lens=[position + 1 for position in positions] + [1] * num_padded,
    )


def is_decode_only(plan) -> bool:
    """Every row of an admitted plan feeds one token (each feeds at least one) and samples
    after it: a step a graph replays. A one-token chunk inside a prompt (the planner cuts
    one where blocks run short) samples nothing, a row with drafts feeds more than one
    token, and the graph's logits hold a row for every plan row."""
    return len(plan.token_ids) == len(plan.seq_ids) and all(plan.sample)


def can_capture(backend_name: str, device_type: str) -> bool:
    """Graphs need CUDA and a backend whose forward launches kernels only (no host loop)."""
    return device_type == "cuda" and backend_name == "triton"


class DecodeGraphs:
    """The captured decode graphs of one engine (torch is imported only here, on CUDA)."""

    def __init__(
        self,
        engine,
        *,
        scratch_block: int,
        buckets: Sequence[int] = DECODE_BUCKETS,
    ) -> None:
        import torch

        self._engine = engine
        self.scratch_block = scratch_block
        self.block_size = engine.block_size
        self.width = engine.block_tables.max_blocks_per_seq  # rows are copied from there
        self.buckets = tuple(buckets)
        self._graphs: dict[int, object] = {}  # bucket -> torch.cuda.CUDAGraph
        device = engine.device
        largest = self.buckets[-1]
        self._input_ids = torch.zeros(1, largest, dtype=torch.long, device=device)
        self._positions = torch.zeros(1, largest, dtype=torch.long, device=device)
        self._slot_mapping = torch.zeros(largest, dtype=torch.long, device=device)
        self._context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self._block_table = torch.full(
            (largest, self.width), scratch_block, dtype=torch.int32, device=device
        )
        self._query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self._rows = torch.arange(largest, dtype=torch.long, device=device)
        # Every forward, replayed or not, copies its logits here (float32, as the sampler
        # reads them): the graphs keep no output of their own alive in the shared pool,
        # so a later capture may reuse what an earlier one's output took (35 outputs of
        # [bucket, vocabulary] would hold 4,231 rows of logits for good).
        vocab_size = engine.model.get_output_embeddings().out_features
        self._logits = torch.zeros(largest, vocab_size, dtype=torch.float32, device=device)
        # Staging buffers, pinned on CUDA: one host-to-device copy per dtype and step. Two
        # sets, used in turn: a step launched ahead (engine.py) stages while the copies of
        # the step before it may not have run yet; the one before that was read.
        self._host_staging = [
            (torch.zeros(4 * largest, dtype=torch.long), torch.zeros(largest, dtype=torch.int32))
            for _ in range(2)
        ]
        if device.type == "cuda":
            self._host_staging = [
                (longs.pin_memory(), ints.pin_memory()) for longs, ints in self._host_staging
            ]
        self._num_staged = 0
        self._pool = None

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def fits(self, plan) -> bool:
        """A decode-only step (an admitted plan) whose padded bucket was captured."""
        if not is_decode_only(plan):
            return False
        bucket = bucket_for(len(plan.seq_ids), self.buckets)
        return bucket is not None and bucket in self._graphs

    def capture(self, budget_s: float = CAPTURE_BUDGET_S) -> None:
        """Capture the buckets, largest first (later ones reuse its memory pool), until
        `budget_s` runs out."""
        import torch

        started_s = time.monotonic()
        self._pool = torch.cuda.graph_pool_handle()
        # Under inference mode, as compute() runs: with autograd on, every captured forward
        # would keep its autograd graph, and the activations it saves, in the graph pool.
        with torch.inference_mode():
            for bucket in sorted(self.buckets, reverse=True):
                if time.monotonic() - started_s > budget_s:
                    log.warning(
                        "CUDA graph capture stopped after %.1f s: %d buckets captured, "
                        "batches above the rest run eagerly",
                        time.monotonic() - started_s,
                        len(self._graphs),
                    )
                    break
                self._capture_one(bucket)
        log.info(
            "captured %d decode CUDA graphs (batch %s) in %.1f s",
            len(self._graphs),
            ", ".join(map(str, self.captured_buckets)),
            time.monotonic() - started_s,
        )

    def _capture_one(self, bucket: int) -> None:
        import torch

        self._stage(pad_decode([PAD_TOKEN_ID], [0], [[self.scratch_block]],
                               block_size=self.block_size, bucket=bucket, width=self.width,
                               scratch_block=self.scratch_block), table_rows=None)  # fmt: skip
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: JIT and autotuning happen outside the capture
                self._forward(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(bucket)
        self._graphs[bucket] = graph

    def run(self, plan, fill=None):
        """The logits of a decode step that `fits`, one row per plan row in order; `fill`
        (paged_engine.TokenFill): the rows fed on the device by the unread step. A bucket
        not captured runs the same padded forward eagerly (how the CPU tests run it)."""
        num_seqs = len(plan.seq_ids)
        bucket = bucket_for(num_seqs, self.buckets)
        engine = self._engine
        rows_of = engine.block_tables.update(plan, engine.table)
        padded = pad_decode(
            plan.token_ids,  # one per row
            plan.start_positions,
            [seq.block_ids for seq in engine.table.sequences_of(plan.seq_ids)],
            block_size=self.block_size,
            bucket=bucket,
            width=self.width,
            scratch_block=self.scratch_block,
        )
        self._stage(padded, [rows_of[seq_id] for seq_id in plan.seq_ids])
        if fill is not None:
            fill.apply(self._input_ids[0], fill.rows)  # decode-only: row i feeds token i
        graph = self._graphs.get(bucket)
        if graph is None:
            return self._forward(bucket)[:num_seqs]
        graph.replay()
        return self._logits[:num_seqs]

    def _stage(self, padded: PaddedDecode, table_rows: list[int] | None) -> None:
        """Copy a padded step into the static buffers (through pinned memory); the block
        table's rows [0, num_seqs) are gathered from the engine's BlockTables rows
        `table_rows` (None: every row is padding, as at capture)."""
        import torch

        bucket, num_seqs = padded.bucket, padded.num_seqs
        rows = table_rows or []
        host_longs, host_ints = self._host_staging[self._num_staged % 2]
        self._num_staged += 1
        longs = host_longs[: 3 * bucket + len(rows)]
        longs.copy_(
            torch.tensor(padded.input_ids + padded.positions + padded.slot_mapping + rows),
        )
        ints = host_ints[:bucket]
        ints.copy_(torch.tensor(padded.context_lens, dtype=torch.int32))
        device_longs = longs.to(self._engine.device, non_blocking=True)
        device_ints = ints.to(self._engine.device, non_blocking=True)
        self._input_ids[0, :bucket].copy_(device_longs[:bucket])
        self._positions[0, :bucket].copy_(device_longs[bucket : 2 * bucket])
        self._slot_mapping[:bucket].copy_(device_longs[2 * bucket : 3 * bucket])
        self._context_lens[:bucket].copy_(device_ints)
        num_gathered = num_seqs if rows else 0
        if num_gathered:
            table = self._engine.block_tables.table
            self._block_table[:num_gathered].copy_(
                table.index_select(0, device_longs[3 * bucket :])
            )
        self._block_table[num_gathered:bucket, 0] = self.scratch_block

    def _forward(self, bucket: int):
        from pagoda.gpu_worker.attention.backend import AttentionMetadata

        engine = self._engine
        max_context_len = self.width * self.block_size  # static: any context fits
        metadata = AttentionMetadata(
            num_tokens=bucket,
            num_seqs=bucket,
            num_decode_seqs=bucket,
            max_query_len=1,
            max_context_len=max_context_len,
            max_decode_context_len=max_context_len,
            block_size=self.block_size,
            query_start_loc=self._query_start_loc[: bucket + 1],
            context_lens=self._context_lens[:bucket],
            block_table=self._block_table[:bucket],
            slot_mapping=self._slot_mapping[:bucket],
            # Never read by a capturable backend (no host loop); views keep the type.
            query_start_loc_cpu=self._query_start_loc[: bucket + 1],
            context_lens_cpu=self._context_lens[:bucket],
        )
        logits = engine.model(
            input_ids=self._input_ids[:, :bucket],
            position_ids=self._positions[:, :bucket],
            logits_to_keep=self._rows[:bucket],
            use_cache=False,
            attention_metadata=metadata,
            kv_pool=engine.pool,
            attention_backend=engine.attention_backend,
        ).logits[0]
        return self._logits[:bucket].copy_(logits)
