"""Structured output on the scheduler: a grammar matcher per constrained request, and each
step's allowed-token bitmasks for the rows that sample a constrained token.

The engine is llguidance (Rust, no torch: the scheduler never imports torch). It needs the
tokenizer's vocabulary, which it reads from tokenizer.json once per (vocabulary size, EOS
ids), about a second on the first constrained request. A request's constraint is compiled
when it is validated (an invalid one is INVALID_ARGUMENT before any work); its matcher
rides on the request (ValidRequest.grammar, opaque to the core) and dies with it. The
compiler keeps the last MAX_CACHED_GRAMMARS constraints' pristine matchers and gives
each later request with the same constraint a copy (microseconds, against 2-7 ms for a
compile, measured: a short request's compile was most of what a constraint cost it).

Each step, after schedule() and before the plan is encoded, `fill_masks` takes the
constrained rows that sample. A row whose tokens are all known (a prompt's last chunk, a
decode after a serial step) gets its mask in the plan: its matcher is fed the tokens the
request generated since (a recompute after preemption feeds none), then the masks of all
such rows are computed at once on llguidance's threads. A row planned ahead under
overlapped steps (in last_sampled_rows) feeds the token of the step in flight, unknown
yet, and its mask needs it: the plan says masks_follow, and once that step's result is
applied, `masks_after` feeds the matchers that token and computes those rows' masks into
the StepMasks the step loop sends after the plan; the worker waits for it only to sample,
so the masks are computed while it runs the forward (about 1.3 ms for 64 rows, measured
in docs/benchmarks.md: on the step loop, no thread hop). A request that ended meanwhile
gets no mask: its token of that step is dropped (the core's ahead rule). A grammar that
is complete and cannot go on allows only EOS, so the request ends with STOP.

A row with n-gram drafts (StepPlan.draft_counts; never planned ahead) samples after its
last token and after each draft: it gets a mask per sample point, its matcher fed the
drafts one by one and rolled back (llguidance does both on its threads), so each sample
is what decoding one token at a time under the grammar gives. The core keeps the samples
while they equal the drafts; catch_up then feeds the matcher the tokens kept. The core
drafts no token the grammar refuses: it asks `num_allowed` first (core.request.Grammar).
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark
from llguidance.numpy import (
    fill_next_token_bitmask_par,
    fill_next_token_bitmask_par_with_draft_tokens,
)

from pagoda.common.step import StepMasks
from pagoda.scheduler_svc.core import StepPlan
from pagoda.scheduler_svc.core.request import Request

log = logging.getLogger("pagoda.grammars")

# Bytes of a constraint's text (schema, regex, grammar, all choices together).
MAX_CONSTRAINT_BYTES = 65536
MAX_CHOICES = 256
# Compiled constraints kept for the next request with the same one (see the docstring).
MAX_CACHED_GRAMMARS = 64
# JSON without whitespace between tokens: a model cannot pad its output with blanks forever.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A constraint the engine refuses (INVALID_ARGUMENT); the message is the sentence."""


@dataclass(frozen=True, slots=True)
class ValidConstraint:
    """A constraint as the request gave it: kind in KINDS, source its text (for "choice",
    a JSON list of the strings; for "json_object", empty). `field`: the request's field it
    came from, for a refusal's sentence (empty: constraint.<kind>)."""

    kind: str
    source: str
    field: str = ""

    @property
    def field_name(self) -> str:
        return self.field or f"constraint.{self.kind}"


KINDS = ("json_schema", "json_object", "regex", "lark_grammar", "gbnf_grammar", "choice")

# Every live RequestGrammar: fill_masks does nothing at all while there is none.
_live: weakref.WeakSet[RequestGrammar] = weakref.WeakSet()


class RequestGrammar:
    """One request's matcher and how many of its generated tokens it has consumed."""

    __slots__ = ("matcher", "eos_token_ids", "num_consumed_tokens", "__weakref__")

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: tuple[int, ...]) -> None:
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.num_consumed_tokens = 0
        _live.add(self)

    def fork(self) -> RequestGrammar:
        """A matcher of its own for another sample of the same request (n > 1), in the
        state of this one before any token: call before this one consumes any."""
        return RequestGrammar(self.matcher.deep_copy(), self.eos_token_ids)

    def num_allowed(self, request: Request, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar allows after `request`'s tokens
        (the core's question before it drafts them: core.request.Grammar)."""
        self.catch_up(request)
        if self.matcher.is_error():
            return 0
        return self.matcher.validate_tokens(token_ids)

    def catch_up(self, request: Request) -> None:
        """Consume the tokens `request` generated since the last call."""
        start = request.num_prompt_tokens + self.num_consumed_tokens
        new_tokens = request.token_ids[start:].tolist()
        if new_tokens:
            if not self.matcher.consume_tokens(new_tokens) and not self.matcher.is_error():
                log.warning("request %s: grammar refused a token", request.request_id)
            self.num_consumed_tokens += len(new_tokens)


def any_live() -> bool:
    return bool(_live)


def _grammar_text(constraint: ValidConstraint) -> str:
    kind, source = constraint.kind, constraint.source
    matcher = llguidance.LLMatcher
    try:
        if kind == "json_schema":
            schema = json.loads(source)
            if not isinstance(schema, dict | bool):
                raise GrammarError(f"{constraint.field_name} must be a JSON object")
            return matcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return matcher.grammar_from_regex(source)
        if kind == "lark_grammar":
            return matcher.grammar_from_lark(source)
        if kind == "gbnf_grammar":
            return matcher.grammar_from_lark(any_to_lark(source))
        if kind == "choice":
            alternatives = " | ".join(json.dumps(choice) for choice in json.loads(source))
            return matcher.grammar_from_lark(f"start: {alternatives}")
    except GrammarError:
        raise
    except Exception as exc:  # the schema's JSON, the GBNF converter's own errors
        raise GrammarError(f"{constraint.field_name} is invalid: {str(exc)[:200]}") from None
    raise GrammarError(f"unknown constraint kind {kind!r}")


class GrammarCompiler:
    """Compiles constraints against the model's vocabulary. Thread-safe: the servicer
    compiles on its tokenizer threads."""

    def __init__(self, tokenizer_json: Callable[[], str]) -> None:
        """`tokenizer_json`: gives tokenizer.json's text (called on the first compile)."""
        self._tokenizer_json = tokenizer_json
        self._tokenizers: dict[tuple[int, tuple[int, ...]], llguidance.LLTokenizer] = {}
        # (vocab size, EOS ids, constraint) -> a matcher that never consumes a token,
        # least recently used first; requests get copies.
        self._compiled: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer(self, vocab_size: int, eos_token_ids: tuple[int, ...]):
        key = (vocab_size, eos_token_ids)
        with self._lock:
            tokenizer = self._tokenizers.get(key)
            if tokenizer is None:
                tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
                )
                self._tokenizers[key] = tokenizer
        return tokenizer

    def compile(
        self, constraint: ValidConstraint, vocab_size: int, eos_token_ids: Collection[int]
    ) -> RequestGrammar:
        """A fresh matcher for one request; GrammarError names what is wrong."""
        eos = tuple(sorted(eos_token_ids))
        if not eos:
            raise GrammarError("structured output needs a model with an EOS token")
        key = (vocab_size, eos, constraint)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return RequestGrammar(compiled.deep_copy(), eos)
        tokenizer = self._tokenizer(vocab_size, eos)
        grammar = _grammar_text(constraint)
        problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if problem:
            raise GrammarError(f"{constraint.field_name} is invalid: {problem[:300]}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{constraint.field_name} is invalid: {matcher.get_error()[:300]}")
        with self._lock:
            self._compiled[key] = matcher
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return RequestGrammar(matcher.deep_copy(), eos)


def mask_words(vocab_size: int) -> int:
    """32-bit words per row of an allowed-token bitmask."""
    return (vocab_size + 31) // 32


_executor: llguidance.LLExecutor | None = None
# Threads that compute a step's masks; the rest of the machine runs the worker.
NUM_MASK_THREADS = 2


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
    if not _live:
        return None
    ahead = set(plan.last_sampled_rows)
    draft_counts, token_ids, ends = plan.draft_counts, plan.token_ids, plan.token_offsets[1:]
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
        num_drafts = draft_counts[index] if draft_counts else 0
        drafts.append(token_ids[ends[index] - num_drafts : ends[index]] if num_drafts else [])
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
    if plain or drafted:
        global _executor
        if _executor is None:
            _executor = llguidance.LLExecutor(num_threads=NUM_MASK_THREADS)
        if plain:
            fill_next_token_bitmask_par(_executor, plain, masks)
        if drafted:
            fill_next_token_bitmask_par_with_draft_tokens(_executor, drafted, masks)
    words = masks.view(np.uint32)
    for row in np.flatnonzero(~words.any(axis=1)):
        k = bisect.bisect_right(starts, row) - 1  # the grammar the row belongs to
        for token_id in grammars[k].eos_token_ids:
            words[row, token_id // 32] |= np.uint32(1 << (token_id % 32))
    return masks.astype("<i4", copy=False).tobytes()
