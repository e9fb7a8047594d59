"""Penalty state on the device: per penalized sequence, which ids it holds (prompt or
generated) and how often it generated each id, kept up to date from each step's fed tokens.

The sampler's repetition penalty needs "seen anywhere" and presence/frequency need the
generated counts. Rebuilding them from Python lists of whole histories costs each step
time that grows with the context (2-68 ms at batch 64-256 in review gpu_path.md); here
a step adds only the tokens it feeds, with one scatter per table.

Only sequences with a penalty get a row: 5 bytes per vocabulary id (bool + int32), so
245 KB for a 49,152-id vocabulary, 61 MB for 256 penalized sequences. Row 0 stays all
zero for sequences without one. A rewound sequence (recompute) is counted again from
its history. Rows of sequences the table no longer holds are reclaimed each step.
"""

from __future__ import annotations

import torch

from pagoda.common.step import SamplingParams, StepPlan
from pagoda.gpu_worker.sequence_table import Sequence, SequenceTable


def has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


class TokenCounts:
    """Called only from the worker's step loop, like the sequence table it follows."""

    def __init__(self, vocab_size: int, device: torch.device, initial_rows: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.seen = torch.zeros(initial_rows, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(initial_rows, vocab_size, dtype=torch.int32, device=device)
        self._rows: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (its Sequence, row)
        self._num_counted: dict[int, int] = {}  # seq_id -> positions [0, n) counted
        self._free_rows = list(range(initial_rows - 1, 0, -1))  # row 0: the zero row

    @property
    def num_rows_in_use(self) -> int:
        return len(self._rows)

    def row_of(self, seq: Sequence) -> int:
        """The sequence's row (0, all zero, when it has no penalty)."""
        entry = self._rows.get(seq.seq_id)
        return entry[1] if entry is not None and entry[0] is seq else 0

    def update(self, plan: StepPlan, table: SequenceTable) -> None:
        """Count the tokens an admitted `plan` feeds (in its sequences' histories now)."""
        self._reclaim(table)
        # (row, token) pairs: every token sets its bit, generated ones also add one each.
        prompt_rows: list[int] = []
        prompt_tokens: list[int] = []
        output_rows: list[int] = []
        output_tokens: list[int] = []
        offsets = plan.token_offsets
        for i, seq in enumerate(table.sequences_of(plan.seq_ids)):
            if not has_penalty(seq.sampling):
                continue
            start = plan.start_positions[i]
            entry = self._rows.get(seq.seq_id)
            counted = self._num_counted.get(seq.seq_id, 0)
            if entry is None or start < counted:
                # New (count the whole history, prefix-cache hits included; a reclaimed row
                # holds its last sequence's counts) or rewound (recompute): count again.
                row = self._take_row(seq) if entry is None else entry[1]
                self.seen[row] = False
                self.output_counts[row] = 0
                counted = 0
            else:
                row = entry[1]
            history = seq.token_ids
            num_prompt = seq.num_prompt_tokens
            end = start + offsets[i + 1] - offsets[i]
            for position in range(counted, min(end, num_prompt)):
                prompt_rows.append(row)
                prompt_tokens.append(history[position])
            for position in range(max(counted, num_prompt), end):
                output_rows.append(row)
                output_tokens.append(history[position])
            self._num_counted[seq.seq_id] = end
        num_prompt_pairs, num_output_pairs = len(prompt_rows), len(output_rows)
        if not num_prompt_pairs + num_output_pairs:
            return
        host = torch.tensor(prompt_rows + prompt_tokens + output_rows + output_tokens)
        if self.device.type != "cpu":
            host = host.pin_memory()
        index = host.to(self.device, non_blocking=True)  # one copy for both tables
        split = 2 * num_prompt_pairs
        seen_rows = torch.cat([index[:num_prompt_pairs], index[split : split + num_output_pairs]])
        seen_tokens = torch.cat([index[num_prompt_pairs:split], index[split + num_output_pairs :]])
        self.seen.index_put_(
            (seen_rows, seen_tokens), torch.ones((), dtype=torch.bool, device=self.device)
        )
        if num_output_pairs:
            self.output_counts.index_put_(
                (index[split : split + num_output_pairs], index[split + num_output_pairs :]),
                torch.ones((), dtype=torch.int32, device=self.device).expand(num_output_pairs),
                accumulate=True,
            )

    def gather(
        self, row_ids: list[int], *, with_counts: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(seen [S, vocab] bool: in the prompt or generated, generated counts [S, vocab] int32,
        or None unless with_counts: only presence/frequency penalties read them)."""
        index = torch.tensor(row_ids, dtype=torch.long).to(self.device, non_blocking=True)
        counts = self.output_counts.index_select(0, index) if with_counts else None
        return self.seen.index_select(0, index), counts

    def _take_row(self, seq: Sequence) -> int:
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self._rows[seq.seq_id] = (seq, row)
        return row

    def _grow(self) -> None:
        old = self.seen.shape[0]
        self.seen = torch.cat([self.seen, torch.zeros_like(self.seen)])
        self.output_counts = torch.cat([self.output_counts, torch.zeros_like(self.output_counts)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _reclaim(self, table: SequenceTable) -> None:
        """Free the rows of sequences the table forgot or replaced (an id reused)."""
        for seq_id, (seq, row) in list(self._rows.items()):
            if table.get(seq_id) is not seq:
                del self._rows[seq_id]
                self._num_counted.pop(seq_id, None)
                self._free_rows.append(row)
