"""Each step's allowed-token bitmasks for the rows that sample a constrained token (the
matchers are scheduler_svc.grammars').

Each step, after schedule() and before the plan is encoded, `fill_masks` takes the
constrained rows that sample. A row whose tokens are all known (a prompt's last chunk, a
decode after a serial step) gets its mask in the plan: its matcher is fed the tokens the
request generated since (a recompute after preemption feeds none), then the masks of all
such rows are computed at once (on llguidance's threads where CPUs are to spare:
`mask_threads`). A row planned ahead under overlapped steps (in last_sampled_rows) feeds
the token of the step in flight, unknown yet, and its mask needs it: the plan says masks_follow, and once that step's result is
applied, `masks_after` feeds the matchers that token and computes those rows' masks into
the StepMasks the step loop sends after the plan; the worker waits for it only to sample,
so the masks are computed while it runs the forward (about 1.3 ms for 64 rows, measured
in docs/benchmarks.md: on the step loop, no thread hop). A request that ended meanwhile
gets no mask: its token of that step is dropped (the core's ahead rule). A grammar that
is complete and cannot go on allows only EOS, so the request ends with STOP.

A row with drafts (StepPlan.draft_counts: the n-gram's or the grammar's forced tokens;
never planned ahead) samples after its last token and after each draft: it gets a mask
per sample point, its matcher fed the drafts one by one and rolled back (on the loop's
thread, or on llguidance's threads where CPUs are to spare, as for the other rows), so
each sample is what decoding one token at a time under the grammar gives. The core keeps
the samples while they equal the drafts; catch_up then feeds the matcher the tokens kept.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import (
    fill_next_token_bitmask,
    fill_next_token_bitmask_par,
    fill_next_token_bitmask_par_with_draft_tokens,
)

from pagoda.common.step import StepMasks, mask_words
from pagoda.scheduler_svc.core import StepPlan
from pagoda.scheduler_svc.core.request import Request
from pagoda.scheduler_svc.grammars import RequestGrammar, any_live

_executor: llguidance.LLExecutor | None = None
# Threads that compute a step's masks; the rest of the machine runs the worker.
NUM_MASK_THREADS = 2
# Below this many CPUs for the scheduler, masks are computed on the loop's own thread: on
# 2 cores, which the worker uses too, waiting for the two threads doubled a step's masks
# (1.03-1.06 ms against 0.51-0.53 ms for 15 rows; docs/benchmarks.md).
MIN_CPUS_FOR_MASK_THREADS = 4


def mask_threads() -> int:
    """The llguidance threads for a step's masks: NUM_MASK_THREADS, or 0 (the loop's
    thread) where the scheduler may run on fewer than MIN_CPUS_FOR_MASK_THREADS CPUs."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return NUM_MASK_THREADS if cpus >= MIN_CPUS_FOR_MASK_THREADS else 0


_num_mask_threads: int | None = None


@dataclass(slots=True)
class PendingMasks:
    """The constrained rows of a plan sent ahead of their token (StepPlan.masks_follow):
    (seq_id, request) each, for masks_after once the step before is applied."""

    step_id: int
    vocab_size: int
    rows: list[tuple[int, Request]]


def fill_masks(
    plan: StepPlan, request_of: Callable[[int], Request | None], vocab_size: int
) -> PendingMasks | None:
    """Set plan.allowed_token_rows and allowed_token_bitmask for the rows that sample a
    constrained token whose tokens are known, and plan.masks_follow when some are planned
    ahead; returns those (see the module docstring). Called from the step loop only."""
    if not any_live():
        return None
    ahead = set(plan.last_sampled_rows)
    rows: list[int] = []
    grammars: list[RequestGrammar] = []
    drafts: list[list[int]] = []
    pending: list[tuple[int, Request]] = []
    for index, (seq_id, samples) in enumerate(zip(plan.seq_ids, plan.sample, strict=True)):
        if not samples:
            continue
        request = request_of(seq_id)
        grammar = request.grammar if request is not None else None
        if grammar is None:
            continue
        assert isinstance(grammar, RequestGrammar)
        if index in ahead:  # never a row with drafts: those feed known tokens only
            pending.append((seq_id, request))
            continue
        grammar.catch_up(request)
        rows.append(index)
        grammars.append(grammar)
        drafts.append(plan.drafts(index))
    if rows:
        plan.allowed_token_rows = rows
        plan.allowed_token_bitmask = _bitmasks(grammars, vocab_size, drafts)
    if not pending:
        return None
    plan.masks_follow = True
    return PendingMasks(plan.step_id, vocab_size, pending)


def masks_after(pending: PendingMasks, request_of: Callable[[int], Request | None]) -> StepMasks:
    """The StepMasks that follow `pending`'s plan, once the step before it is applied:
    the masks of its rows whose request still runs, each matcher fed the token that step
    sampled first. Called from the step loop only."""
    seq_ids: list[int] = []
    grammars: list[RequestGrammar] = []
    for seq_id, request in pending.rows:
        if request_of(seq_id) is not request:
            continue  # it ended, was preempted or its step failed: its token is dropped
        grammar = request.grammar
        assert isinstance(grammar, RequestGrammar)
        grammar.catch_up(request)
        seq_ids.append(seq_id)
        grammars.append(grammar)
    bitmask = _bitmasks(grammars, pending.vocab_size) if grammars else b""
    return StepMasks(step_id=pending.step_id, seq_ids=seq_ids, allowed_token_bitmask=bitmask)


def _mask_executor() -> llguidance.LLExecutor:
    """llguidance's NUM_MASK_THREADS threads, made on first use."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor(num_threads=NUM_MASK_THREADS)
    return _executor


def _bitmasks(
    grammars: list[RequestGrammar], vocab_size: int, drafts: list[list[int]] | None = None
) -> bytes:
    """The bitmasks of `grammars` (caught up), as the wire has them: one row each, or with
    `drafts` (per grammar, its row's drafts) d + 1 rows for d drafts, the mask after each
    (the matcher fed the drafts before it, then rolled back). A point after a draft the
    grammar refuses allows only EOS: its sample is never kept (the one before it could
    not be that draft), and the sampler needs some token to allow."""
    counts = [len(row_drafts) + 1 for row_drafts in drafts] if drafts else [1] * len(grammars)
    starts = [0, *itertools.accumulate(counts)]
    masks = np.zeros((starts[-1], mask_words(vocab_size)), dtype=np.int32)
    plain: list[tuple[llguidance.LLMatcher, int]] = []
    drafted: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
    for k, grammar in enumerate(grammars):
        if grammar.matcher.is_error():
            continue  # a token it refused (a bug): its rows allow EOS only, so it ends at once
        if counts[k] > 1:
            drafted.append((grammar.matcher, starts[k], drafts[k]))
        else:
            plain.append((grammar.matcher, starts[k]))
    global _num_mask_threads
    if _num_mask_threads is None:
        _num_mask_threads = mask_threads()
    if not _num_mask_threads:
        for matcher, row in plain:
            fill_next_token_bitmask(matcher, masks, row)
        for matcher, row, row_drafts in drafted:
            _fill_drafted(matcher, masks, row, row_drafts)
    else:
        if plain:
            fill_next_token_bitmask_par(_mask_executor(), plain, masks)
        if drafted:
            fill_next_token_bitmask_par_with_draft_tokens(_mask_executor(), drafted, masks)
    words = masks.view(np.uint32)
    for row in np.flatnonzero(~words.any(axis=1)):
        k = bisect.bisect_right(starts, row) - 1  # the grammar the row belongs to
        for token_id in grammars[k].eos_token_ids:
            words[row, token_id // 32] |= np.uint32(1 << (token_id % 32))
    return masks.astype("<i4", copy=False).tobytes()


def _fill_drafted(
    matcher: llguidance.LLMatcher, masks: np.ndarray, row: int, drafts: list[int]
) -> None:
    """A drafted row's masks on this thread, as llguidance's threads compute them: the mask
    at `row` + i after the first i drafts, the matcher fed them one by one and then rolled
    back. Past a draft the grammar refuses, the rows stay empty (EOS only, _bitmasks)."""
    num_fed = 0
    for draft in drafts:
        fill_next_token_bitmask(matcher, masks, row + num_fed)
        if matcher.try_consume_tokens([draft]) != 1:
            break
        num_fed += 1
    else:
        fill_next_token_bitmask(matcher, masks, row + num_fed)
    if num_fed:
        matcher.rollback(num_fed)
