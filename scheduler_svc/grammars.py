"""Structured output on the scheduler: a grammar matcher per constrained request, and each
step's allowed-token bitmasks for the rows that sample a constrained token.

The engine is llguidance (Rust, no torch: the scheduler never imports torch). It needs the
tokenizer's vocabulary, which it reads from tokenizer.json once per (vocabulary size, EOS
ids), about a second on the first constrained request. A request's constraint is compiled
when it is validated (an invalid one is INVALID_ARGUMENT before any work); its matcher
rides on the request (ValidRequest.grammar, opaque to the core) and dies with it.

Each step, after schedule() and before the plan is encoded, `fill_masks` first feeds
every constrained row's matcher the tokens it has not seen (those the request generated
since; a recompute after preemption feeds none), then computes all their masks at once
on llguidance's threads. The core never plans a constrained request ahead of its last
token (overlapped steps), so its tokens are all known here; under overlapped steps it
therefore runs every other step. A grammar that is complete and cannot go on allows only
EOS, so the request ends with STOP.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark
from llguidance.numpy import fill_next_token_bitmask_par

from pagoda.scheduler_svc.core import StepPlan
from pagoda.scheduler_svc.core.request import Request

log = logging.getLogger("pagoda.grammars")

# Bytes of a constraint's text (schema, regex, grammar, all choices together).
MAX_CONSTRAINT_BYTES = 65536
MAX_CHOICES = 256
# JSON without whitespace between tokens: a model cannot pad its output with blanks forever.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A constraint the engine refuses (INVALID_ARGUMENT); the message is the sentence."""


@dataclass(frozen=True, slots=True)
class ValidConstraint:
    """A constraint as the request gave it: kind in KINDS, source its text (for "choice",
    a JSON list of the strings; for "json_object", empty)."""

    kind: str
    source: str


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
                raise GrammarError("constraint.json_schema must be a JSON object")
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
        raise GrammarError(f"constraint.{kind} is invalid: {str(exc)[:200]}") from None
    raise GrammarError(f"unknown constraint kind {kind!r}")


class GrammarCompiler:
    """Compiles constraints against the model's vocabulary. Thread-safe: the servicer
    compiles on its tokenizer threads."""

    def __init__(self, tokenizer_json: Callable[[], str]) -> None:
        """`tokenizer_json`: gives tokenizer.json's text (called on the first compile)."""
        self._tokenizer_json = tokenizer_json
        self._tokenizers: dict[tuple[int, tuple[int, ...]], llguidance.LLTokenizer] = {}
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
        tokenizer = self._tokenizer(vocab_size, eos)
        grammar = _grammar_text(constraint)
        problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if problem:
            raise GrammarError(f"constraint.{constraint.kind} is invalid: {problem[:300]}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(
                f"constraint.{constraint.kind} is invalid: {matcher.get_error()[:300]}"
            )
        return RequestGrammar(matcher, eos)


def mask_words(vocab_size: int) -> int:
    """32-bit words per row of an allowed-token bitmask."""
    return (vocab_size + 31) // 32


_executor: llguidance.LLExecutor | None = None
# Threads that compute a step's masks; the rest of the machine runs the worker.
NUM_MASK_THREADS = 2


def fill_masks(
    plan: StepPlan, request_of: Callable[[int], Request | None], vocab_size: int
) -> None:
    """Set plan.allowed_token_rows and allowed_token_bitmask for the rows that sample a
    constrained token (see the module docstring). Called from the step loop only."""
    if not _live:
        return
    rows: list[int] = []
    grammars: list[RequestGrammar] = []
    for index, (seq_id, samples) in enumerate(zip(plan.seq_ids, plan.sample, strict=True)):
        if not samples:
            continue
        request = request_of(seq_id)
        grammar = request.grammar if request is not None else None
        if grammar is not None:
            assert isinstance(grammar, RequestGrammar)
            grammar.catch_up(request)
            rows.append(index)
            grammars.append(grammar)
    if not rows:
        return
    masks = np.zeros((len(rows), mask_words(vocab_size)), dtype=np.int32)
    working = [(g.matcher, k) for k, g in enumerate(grammars) if not g.matcher.is_error()]
    if working:
        global _executor
        if _executor is None:
            _executor = llguidance.LLExecutor(num_threads=NUM_MASK_THREADS)
        fill_next_token_bitmask_par(_executor, working, masks)
    words = masks.view(np.uint32)
    for k, grammar in enumerate(grammars):
        if grammar.matcher.is_error():  # a token it refused (a bug): let it end at once
            words[k] = 0
            for token_id in grammar.eos_token_ids:
                words[k, token_id // 32] |= np.uint32(1 << (token_id % 32))
    plan.allowed_token_rows = rows
    plan.allowed_token_bitmask = masks.astype("<i4", copy=False).tobytes()
