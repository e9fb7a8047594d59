"""Requests: the validated input, the scheduler's mutable state of one, and its output events.

Times (`*_s`) are seconds on the caller's monotonic clock, passed in as `now`;
durations sent to clients are milliseconds (`*_ms`).
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagoda.scheduler_svc.core.stop_rules import StopStringMatcher
    from pagoda.scheduler_svc.detokenizer import IncrementalDetokenizer


@dataclass(frozen=True, slots=True)
class ValidSampling:
    """Sampling parameters after validation: top_p 1.0 and repetition_penalty 1.0 mean off."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    num_logprobs: int  # top-n alternatives per generated token; 0: no logprobs at all


@dataclass(frozen=True, slots=True)
class ValidStopping:
    max_new_tokens: int
    min_new_tokens: int  # EOS, stop token ids and stop strings are ignored before this many
    stop_strings: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool


@dataclass(frozen=True, slots=True)
class ValidRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: ValidSampling
    stopping: ValidStopping
    priority: int = 0  # lower runs first under the priority policy


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens reached or the context is full
    STOP = "stop"  # EOS, a stop token id or a stop string
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int  # times preempted and recomputed


@dataclass(slots=True)
class Timings:
    queued_ms: float  # arrival to first scheduled
    first_token_ms: float  # arrival to the first generated token
    total_ms: float  # arrival to finish


@dataclass(slots=True)
class RequestOutput:
    """One event to stream to a client: what is new since the previous event."""

    request_id: str
    # Whole UTF-8 characters only; text that may begin a stop string is held back.
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # one per token in token_ids when asked for
    finish_reason: FinishReason | None = None
    error_message: str | None = None
    usage: Usage | None = None  # the finishing event only
    timings: Timings | None = None  # the finishing event only


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and back at the head of the queue
    RUNNING = "running"  # owns a sequence on the worker and KV blocks
    FINISHED = "finished"


def token_array(token_ids: Iterable[int]) -> array[int]:
    """A request's token ids as 64-bit C integers rather than a list of int objects, which
    every collection would visit, block keying would read from all over memory and a
    finish would free one by one (together ~8% of a step at 1,000 running requests)."""
    return array("q", token_ids)


@dataclass(slots=True, eq=False)
class Request:
    """The scheduler's truth about one request; owned and mutated by the Scheduler only.

    A running request feeds `token_ids[num_computed_tokens:]`: prefill, chunked
    prefill, prefix hits, recompute after preemption and decode are all "give it n
    more tokens". Every admission names a fresh sequence (`seq_id`) on the worker.
    """

    request_id: str
    sampling: ValidSampling
    stopping: ValidStopping
    priority: int
    num_prompt_tokens: int
    # Prompt then generated tokens (token_array()). Generated tokens are streamed
    # exactly once, when appended, so a recompute after preemption never repeats one.
    token_ids: array[int]
    arrival_s: float
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher | None  # None when there are no stop strings
    state: RequestState = RequestState.WAITING
    seq_id: int | None = None
    # Tokens of token_ids whose KV is in block_ids, counting those fed by the step in flight.
    num_computed_tokens: int = 0
    # Block table of the current sequence (prefix hits first); append-only while running.
    block_ids: list[int] = field(default_factory=list)
    num_blocks_sent: int = 0  # prefix of block_ids the worker already holds for seq_id
    # Chained hashes of token_ids' full blocks, computed lazily and kept across
    # preemptions (tokens never change once known).
    block_hashes: list[int] = field(default_factory=list)
    admit_order: int = 0  # stamp of the latest admission; preemption picks the latest
    last_scheduled_step: int = -1  # step_id of the last plan that fed this request
    num_cached_prompt_tokens: int | None = None  # prefix hit at first admission
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    # apply()'s short path, fixed at each admission as it depends on the worker: while
    # steady_from <= len(token_ids) < steady_until (counting the new token), a token is
    # not the first generated one, stops are allowed, and neither max_new_tokens nor the
    # context is reached, so only a token id in ending_token_ids or a stop string can
    # end the request.
    steady_from: int = 0
    steady_until: int = 0
    ending_token_ids: frozenset[int] = frozenset()
    # Copies kept on the request so a decode step touches only it, not the objects they
    # come from (at 1,000 running each is a cache miss per request: ~90 us a step here).
    last_token_id: int = -1  # token_ids[-1]: the token a decoding sequence feeds next
    whole_texts: list[str | None] | tuple[()] = ()  # detokenizer.whole_texts, after every call

    def set_steady_window(self, eos_token_ids: frozenset[int], max_context_tokens: int) -> None:
        stopping = self.stopping
        self.steady_from = self.num_prompt_tokens + 1 + max(stopping.min_new_tokens, 1)
        self.steady_until = min(
            self.num_prompt_tokens + stopping.max_new_tokens, max_context_tokens
        )
        if stopping.ignore_eos:
            self.ending_token_ids = stopping.stop_token_ids
        elif stopping.stop_token_ids:
            self.ending_token_ids = stopping.stop_token_ids | eos_token_ids
        else:
            self.ending_token_ids = eos_token_ids  # one set for most requests: stays cached

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_to_feed(self) -> int:
        """Tokens still to compute before the next sample (1 when decoding)."""
        return len(self.token_ids) - self.num_computed_tokens

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_generated_tokens,
            cached_prompt_tokens=self.num_cached_prompt_tokens or 0,
            num_preemptions=self.num_preemptions,
        )

    def timings(self) -> Timings:
        """Milliseconds since arrival, once finished; a stage never reached counts as the end."""
        assert self.finish_s is not None
        end_s = self.finish_s
        scheduled_s = self.first_scheduled_s if self.first_scheduled_s is not None else end_s
        first_token_s = self.first_token_s if self.first_token_s is not None else end_s
        return Timings(
            queued_ms=(scheduled_s - self.arrival_s) * 1000.0,
            first_token_ms=(first_token_s - self.arrival_s) * 1000.0,
            total_ms=(end_s - self.arrival_s) * 1000.0,
        )
