"""Block tables on the device: one row per live sequence of a [rows, max_blocks] int32
tensor, appended from each plan's new blocks.

A step then copies B row numbers to the device and gathers its [B, max_blocks] table
there, instead of building B x ceil(L / block_size) Python ints and copying them. Block
tables are append-only (pagoda.gpu_worker.sequence_table), so a step writes only the
blocks its plan adds. Rows of sequences the table forgot or replaced (an id reused) are
reclaimed each step; a reclaimed row keeps stale ids past its new sequence's blocks,
which no backend reads (a row's keys end at its context length, padding is masked).
"""

from __future__ import annotations

import torch

from pagoda.common.step import StepPlan
from pagoda.gpu_worker.sequence_table import Sequence, SequenceTable
from pagoda.gpu_worker.step_events import upload


class BlockTables:
    """Called only from the worker's step loop, like the sequence table it follows."""

    def __init__(self, max_blocks_per_seq: int, device: torch.device, initial_rows: int = 64):
        self.device = device
        self.table = torch.zeros(initial_rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._rows: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (its Sequence, row)
        self._num_synced: dict[int, int] = {}  # seq_id -> blocks already on the device
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    @property
    def max_blocks_per_seq(self) -> int:
        return self.table.shape[1]

    @property
    def num_rows_in_use(self) -> int:
        return len(self._rows)

    def update(self, plan: StepPlan, table: SequenceTable) -> dict[int, int]:
        """Bring the rows of an admitted plan's sequences up to date (one copy, one
        scatter); returns each one's row, by seq_id."""
        self._reclaim(table)
        rows_of: dict[int, int] = {}
        rows: list[int] = []
        columns: list[int] = []
        block_ids: list[int] = []
        for seq in table.sequences_of(plan.seq_ids):
            entry = self._rows.get(seq.seq_id)
            if entry is None:
                row, synced = self._take_row(seq), 0
            else:
                row, synced = entry[1], self._num_synced[seq.seq_id]
            ids = seq.block_ids
            if len(ids) > synced:
                rows.extend([row] * (len(ids) - synced))
                columns.extend(range(synced, len(ids)))
                block_ids.extend(ids[synced:])
                self._num_synced[seq.seq_id] = len(ids)
            rows_of[seq.seq_id] = row
        if rows:
            _, values = upload(rows + columns + block_ids, torch.long, self.device)
            num = len(rows)
            self.table.index_put_(
                (values[:num], values[num : 2 * num]), values[2 * num :].to(torch.int32)
            )
        return rows_of

    def _take_row(self, seq: Sequence) -> int:
        if not self._free_rows:
            old = self.table.shape[0]
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self._free_rows.extend(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self._rows[seq.seq_id] = (seq, row)
        self._num_synced[seq.seq_id] = 0
        return row

    def _reclaim(self, table: SequenceTable) -> None:
        for seq_id, (seq, row) in list(self._rows.items()):
            if table.get(seq_id) is not seq:
                del self._rows[seq_id]
                del self._num_synced[seq_id]
                self._free_rows.append(row)
