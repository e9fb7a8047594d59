"""Structured output on the scheduler: a grammar matcher per constrained request.

The engine is llguidance (Rust, no torch: the scheduler never imports torch). It needs the
tokenizer's vocabulary, which it reads from tokenizer.json once per (vocabulary size, EOS
ids), about a second on the first constrained request. A request's constraint is compiled
when it is validated (an invalid one is INVALID_ARGUMENT before any work); its matcher
rides on the request (ValidRequest.grammar, opaque to the core but for two questions,
core.request.Grammar) and dies with it. The compiler keeps the last MAX_CACHED_GRAMMARS
constraints' pristine matchers and gives each later request with the same constraint a
copy (microseconds, against 2-7 ms for a compile, measured: a short request's compile was
most of what a constraint cost it). Each step's allowed-token bitmasks are
scheduler_svc.grammar_masks'. The core drafts the tokens a grammar forces
(`RequestGrammar.forced_tokens`), else none it refuses (`num_allowed`).
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from pagoda.scheduler_svc.core.request import Request
from pagoda.scheduler_svc.reasoning import THINK_CLOSE, THINK_OPEN, Thinking

log = logging.getLogger("pagoda.grammars")

# Bytes of a constraint's text (schema, regex, grammar, all choices together).
MAX_CONSTRAINT_BYTES = 65536
MAX_CHOICES = 256
# Compiled constraints kept for the next request with the same one (see the docstring).
MAX_CACHED_GRAMMARS = 64
# JSON without whitespace between tokens: a model cannot pad its output with blanks forever.
JSON_OPTIONS = {"whitespace_flexible": False}


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

    def forced_tokens(self, request: Request) -> list[int]:
        """The tokens the grammar forces after `request`'s tokens, as llguidance tokenizes
        forced text (its fast-forward tokens: a JSON key, a tool's name): drafts the
        model keeps but where it spells them otherwise (core.request.Grammar)."""
        return self.matcher.compute_ff_tokens() if self._caught_up(request) else []

    def num_allowed(self, request: Request, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar allows after `request`'s tokens
        (the core's question before it drafts them: core.request.Grammar)."""
        return self.matcher.validate_tokens(token_ids) if self._caught_up(request) else 0

    def _caught_up(self, request: Request) -> bool:
        """catch_up, then whether the matcher can still answer (it refused no token)."""
        self.catch_up(request)
        return not self.matcher.is_error()

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


def id_ranges(token_ids: list[int]) -> str:
    """Sorted ids as llguidance's token ranges: [1, 2, 3, 7] -> "1-3,7"."""
    ranges: list[list[int]] = []
    for token_id in token_ids:
        if ranges and token_id == ranges[-1][1] + 1:
            ranges[-1][1] = token_id
        else:
            ranges.append([token_id, token_id])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


@dataclass(frozen=True, slots=True)
class ThinkingFirst:
    """A thinking model's thinking before a constraint's output (reasoning.py): where it
    stands when the output begins, and the model's added tokens (text, id), which
    llguidance sees as tokens only: the tags may be among them."""

    thinking: Thinking
    added_tokens: tuple[tuple[str, int], ...]


def _thinking_first(grammar: str, first: ThinkingFirst, eos_token_ids: tuple[int, ...]) -> str:
    """`grammar` (a top-level grammar's JSON, or Lark) after the model's thinking: under
    BEGUN, any text (added tokens too) until </think>; under MAY_BEGIN, the same opened
    by <think>, or none at all. A few blanks may follow the thinking, as templates write
    them; then the constraint's output. A tag that is an added token is taken as the
    token or as its spelled text (the reader splits on the text alone). No EOS ends the
    thinking: the output ends in the constraint's."""
    added = dict(first.added_tokens)
    opening = [json.dumps(THINK_OPEN)]
    if THINK_OPEN in added:
        opening.append(f"<[{added[THINK_OPEN]}]>")
    closing = ["closing_text"]
    if THINK_CLOSE in added:
        closing.append(f"TEXT <[{added[THINK_CLOSE]}]>")
    inside = sorted(
        token_id
        for text, token_id in first.added_tokens
        if text != THINK_CLOSE and token_id not in eos_token_ids
    )
    thought = "(TEXT added_token)* closing BLANKS"
    lines = [
        "%llguidance {}",
        "start: thought @answer"
        if first.thinking is Thinking.BEGUN
        else "start: (opening thought)? @answer",
        f"thought: {thought}" if inside else "thought: closing BLANKS",
        f"opening: {' | '.join(opening)}",
        f"closing: {' | '.join(closing)}",
        f"closing_text[lazy]: TEXT {json.dumps(THINK_CLOSE)}",
        r"TEXT: /(.|\n)*/",
        r"BLANKS: /[ \t\n]{0,4}/",
    ]
    if inside:
        lines.append(f"added_token: <[{id_ranges(inside)}]>")
    if grammar.lstrip().startswith("{"):
        answer = json.loads(grammar)["grammars"]
        if len(answer) != 1:
            raise GrammarError("a constraint of several grammars cannot follow a thinking")
        answer = [{**answer[0], "name": "answer"}]
    else:
        answer = [{"name": "answer", "lark_grammar": grammar}]
    return json.dumps(
        {"grammars": [{"name": "thinking", "lark_grammar": "\n".join(lines)}, *answer]}
    )


def _grammar_text(constraint: ValidConstraint) -> str:
    kind, source = constraint.kind, constraint.source
    matcher = llguidance.LLMatcher
    try:
        if kind == "json_schema":
            schema = json.loads(source)
            if not isinstance(schema, dict | bool):
                raise GrammarError(f"{constraint.field_name} must be a JSON object")
            return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
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
        self,
        constraint: ValidConstraint,
        vocab_size: int,
        eos_token_ids: Collection[int],
        thinking_first: ThinkingFirst | None = None,
    ) -> RequestGrammar:
        """A fresh matcher for one request (its output the model's thinking first, then
        the constraint's, with `thinking_first`); GrammarError names what is wrong."""
        eos = tuple(sorted(eos_token_ids))
        if not eos:
            raise GrammarError("structured output needs a model with an EOS token")
        key = (vocab_size, eos, constraint, thinking_first)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return RequestGrammar(compiled.deep_copy(), eos)
        tokenizer = self._tokenizer(vocab_size, eos)
        grammar = _grammar_text(constraint)
        if thinking_first is not None:
            grammar = _thinking_first(grammar, thinking_first, eos)
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
