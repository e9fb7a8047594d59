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

A row with drafts (StepPlan.draft_counts) is counted without them: the scheduler keeps
some, and the next row feeds from after those, so `update` counts the kept ones then. Its
sample after the j-th draft reads the counts with drafts 1..j added (`add_drafts`, on the
gathered copies), as decoding one token at a time would have counted them.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import torch

from pagoda.common.step import StepPlan, has_penalty
from pagoda.gpu_worker.sequence_table import SamplingRows, Sequence, SequenceTable
from pagoda.gpu_worker.step_events import upload

if TYPE_CHECKING:
    from pagoda.gpu_worker.paged_engine import TokenFill


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

    def update(self, plan: StepPlan, table: SequenceTable, fill: TokenFill | None = None) -> None:
        """Count the tokens an admitted `plan` feeds (in its sequences' histories now; a
        row that `fill` feeds, launched ahead, has its token on the device alone)."""
        self._reclaim(table)
        penalized = [
            (i, seq)
            for i, seq in enumerate(table.sequences_of(plan.seq_ids))
            if has_penalty(seq.sampling)
        ]
        if not penalized:
            return
        self._reserve(sum(1 for _, seq in penalized if seq.seq_id not in self._rows))
        # (row, token) pairs: every token sets its bit, generated ones also add one each.
        prompt_rows: list[int] = []
        prompt_tokens: list[int] = []
        output_rows: list[int] = []
        output_tokens: list[int] = []
        cleared: list[int] = []  # rows counted from position 0 again
        # Rows whose one token the unread step sampled (PENDING_TOKEN in the history): its
        # row here and its index in that step's tokens, counted from the device.
        source_of = dict(zip(fill.rows, fill.sources, strict=True)) if fill is not None else {}
        device_rows: list[int] = []
        device_sources: list[int] = []
        offsets, draft_counts = plan.token_offsets, plan.draft_counts
        for i, seq in penalized:
            start = plan.start_positions[i]
            entry = self._rows.get(seq.seq_id)
            counted = self._num_counted.get(seq.seq_id, 0)
            if entry is None or start < counted:
                # New (count the whole history, prefix-cache hits included; a reclaimed row
                # holds its last sequence's counts) or rewound (recompute): count again.
                row = self._take_row(seq) if entry is None else entry[1]
                cleared.append(row)
                counted = 0
            else:
                row = entry[1]
            history = seq.token_ids
            num_prompt = seq.num_prompt_tokens
            end = start + offsets[i + 1] - offsets[i]
            if draft_counts:  # drafts count once kept: the next row feeds from after them
                end -= draft_counts[i]
            self._num_counted[seq.seq_id] = end
            if i in source_of:  # a sampled token: generated
                device_rows.append(row)
                device_sources.append(source_of[i])
                end -= 1
            prompt_end = min(end, num_prompt)
            if prompt_end > counted:
                prompt_rows += [row] * (prompt_end - counted)
                prompt_tokens += history[counted:prompt_end]
            output_start = max(counted, num_prompt)
            if end > output_start:
                output_rows += [row] * (end - output_start)
                output_tokens += history[output_start:end]
        if cleared:
            _, index = upload(cleared, torch.long, self.device)
            self.seen.index_fill_(0, index, False)
            self.output_counts.index_fill_(0, index, 0)
        self._count_from_host(prompt_rows, prompt_tokens, output_rows, output_tokens)
        if device_rows:
            _, index = upload(device_rows + device_sources, torch.long, self.device)
            num_rows = len(device_rows)
            pairs = (index[:num_rows], fill.tokens.index_select(0, index[num_rows:]))
            _count_into(self.seen, self.output_counts, pairs, pairs)  # sampled: generated

    def _count_from_host(
        self,
        prompt_rows: list[int],
        prompt_tokens: list[int],
        output_rows: list[int],
        output_tokens: list[int],
    ) -> None:
        """Count (row, token) pairs from host lists into the tables (_count_into): every
        pair seen, the output pairs also generated; in one copy to the device."""
        num_prompt_pairs, num_output_pairs = len(prompt_rows), len(output_rows)
        if not num_prompt_pairs + num_output_pairs:
            return
        # Through an array: torch.tensor of a list converts it int by int (a million ids,
        # as a burst of 256 new 1K-token penalized prompts gives: 200 ms, 26 ms this way).
        pairs = array("q", prompt_rows + prompt_tokens + output_rows + output_tokens)
        host = torch.frombuffer(pairs, dtype=torch.long)
        if self.device.type != "cpu":
            host = host.pin_memory()
        index = host.to(self.device, non_blocking=True)  # one copy for both tables
        split = 2 * num_prompt_pairs
        output = (index[split : split + num_output_pairs], index[split + num_output_pairs :])
        seen = (
            torch.cat([index[:num_prompt_pairs], output[0]]),
            torch.cat([index[num_prompt_pairs:split], output[1]]),
        )
        _count_into(self.seen, self.output_counts, seen, output)

    def gather(
        self, row_ids: list[int], *, with_counts: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(seen [S, vocab] bool: in the prompt or generated, generated counts [S, vocab] int32,
        or None unless with_counts: only presence/frequency penalties read them)."""
        index = torch.tensor(row_ids, dtype=torch.long).to(self.device, non_blocking=True)
        counts = self.output_counts.index_select(0, index) if with_counts else None
        return self.seen.index_select(0, index), counts

    def add_drafts(
        self, seen: torch.Tensor, counts: torch.Tensor | None, sampling: SamplingRows
    ) -> None:
        """Count, in `gather`'s copies for `sampling`'s points, the drafts fed before each
        point of a penalized row with drafts: the history a token decoded alone there
        would follow (`update` counts a row's drafts only once they are kept)."""
        drafted = sampling.drafted_seq_ids
        points: list[int] = []
        token_ids: list[int] = []
        first: tuple[Sequence, int] | None = None  # the row's sequence, its first point
        for point, (seq, position) in enumerate(
            zip(sampling.sequences, sampling.positions, strict=True)
        ):
            if seq.seq_id not in drafted or not has_penalty(seq.sampling):
                continue
            if first is None or first[0] is not seq:
                first = (seq, position)  # its first point follows its last real token
            drafts = seq.token_ids[first[1] : position]
            points += [point] * len(drafts)
            token_ids += drafts
        if not points:
            return
        _, index = upload(points + token_ids, torch.long, self.device)
        pairs = (index[: len(points)], index[len(points) :])
        _count_into(seen, counts, pairs, pairs)  # drafts: generated

    def _take_row(self, seq: Sequence) -> int:
        row = self._free_rows.pop()  # _reserve made sure there is one
        self._rows[seq.seq_id] = (seq, row)
        return row

    def _reserve(self, num_rows: int) -> None:
        """At least `num_rows` free rows: the tables grow once, doubling as often as needed
        (a burst of new penalized sequences copies them once, not once per doubling)."""
        if num_rows <= len(self._free_rows):
            return
        old = self.seen.shape[0]
        new = old
        while new - old + len(self._free_rows) < num_rows:
            new *= 2
        seen = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        seen[:old] = self.seen
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        counts[:old] = self.output_counts
        self.seen, self.output_counts = seen, counts
        self._free_rows.extend(range(new - 1, old - 1, -1))

    def _reclaim(self, table: SequenceTable) -> None:
        """Free the rows of sequences the table forgot or replaced (an id reused)."""
        for seq_id, (seq, row) in list(self._rows.items()):
            if table.get(seq_id) is not seq:
                del self._rows[seq_id]
                self._num_counted.pop(seq_id, None)
                self._free_rows.append(row)


def _count_into(
    seen_table: torch.Tensor,
    counts_table: torch.Tensor | None,
    seen: tuple[torch.Tensor, torch.Tensor],
    generated: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """seen_table[row, token] = True for each (rows, tokens) pair of `seen`, and one more
    in counts_table[row, token] (unless None) for each pair of `generated` (device tensors
    on the tables' device)."""
    device = seen_table.device
    seen_table.index_put_(seen, torch.ones((), dtype=torch.bool, device=device))
    num_generated = generated[0].shape[0]
    if counts_table is not None and num_generated:
        counts_table.index_put_(
            generated,
            torch.ones((), dtype=torch.int32, device=device).expand(num_generated),
            accumulate=True,
        )
