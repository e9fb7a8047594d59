"""Requests: the validated input, the scheduler's state of one, and the token-id stop rules.

Times (`*_s`) are seconds on the caller's monotonic clock, passed in as `now`.
"""

from __future__ import annotations

import enum
import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from pagoda.common.step import SamplingParams, WorkerGeometry
from pagoda.scheduler_svc.core.kv import ROOT_HASH


class Grammar(Protocol):
    """A constrained request's matcher (scheduler_svc.grammars.RequestGrammar): the core
    asks it what to draft: the tokens it forces next, else no token it refuses."""

    def forced_tokens(self, request: Request) -> list[int]:
        """The tokens the grammar forces after `request`'s tokens (none: [])."""
        ...

    def num_allowed(self, request: Request, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar allows after `request`'s tokens."""
        ...


@dataclass(frozen=True, slots=True)
class ValidStopping:
    max_new_tokens: int
    # Until this many tokens are generated, the worker masks EOS and the stop token ids out
    # of the logits, and stop strings are not matched.
    min_new_tokens: int
    stop_strings: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool


@dataclass(frozen=True, slots=True)
class ValidRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stopping: ValidStopping
    priority: int = 0  # lower runs first under the priority policy
    # Requests share prefix-cache blocks only with requests of the same salt (tenants).
    cache_salt: str = ""
    # Who sent it (a name, never a key) and its weight: the fair share (core/tenants.py).
    tenant: str = ""
    tenant_weight: float = 1.0
    # Structured output: the service's grammar matcher (scheduler_svc.grammars), opaque to
    # the core but for Grammar's one question.
    grammar: Grammar | None = None
    # Samples of this prompt (n): n core requests named by sample_request_ids, sharing
    # the prompt's KV blocks (see Request.prompt_leader).
    n: int = 1
    # With a grammar and n > 1: the matchers of samples 1 to n-1 (each its own state).
    sample_grammars: tuple[Grammar, ...] = ()
    # A Chat request's tools (scheduler_svc.tools.ValidTools), opaque to the core: the text
    # stage reads the output for their calls.
    tools: object | None = None
    # A Chat request's thinking (scheduler_svc.reasoning.Thinking; None: its output is not
    # split), opaque to the core: the text stage and the edge keep reasoning apart.
    thinking: object | None = None
    # Seconds the caller waits from now (its gRPC deadline's time remaining; None: none):
    # the `deadline` admission policy starts the earliest deadline first.
    time_limit_s: float | None = None


def sample_request_ids(request_id: str, n: int) -> list[str]:
    """The core request ids of the n samples of the call `request_id`: the id itself when
    n is 1, else `request_id#i`. Cancelling the call cancels each of them."""
    if n == 1:
        return [request_id]
    return [f"{request_id}#{index}" for index in range(n)]


def sample_seed(seed: int, index: int) -> int:
    """Sample `index`'s seed: seed + index, within the 64 bits of SamplingParams.seed."""
    return (seed + index) & 0xFFFF_FFFF_FFFF_FFFF


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens reached or the context is full
    STOP = "stop"  # EOS, a stop token id or a stop string
    CANCELLED = "cancelled"
    ERROR = "error"


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and back at the head of the queue
    # A sample i > 0 of an n > 1 request, held out of the queue until its sample 0 has
    # computed (or is computing) the prompt's full blocks (Scheduler, not the planner).
    HELD = "held"
    RUNNING = "running"  # owns a sequence on the worker and KV blocks
    FINISHED = "finished"


def token_array(token_ids: Iterable[int]) -> array[int]:
    """A request's token ids as 64-bit C integers rather than a list of int objects, which
    every collection would visit, block keying would read from all over memory and a
    finish would free one by one."""
    return array("q", token_ids)


@dataclass(slots=True, eq=False)
class Request:
    """The scheduler's truth about one request.

    Two writers, by field: the planner (with its RunningSet) and the PlanBuilder of its
    plan write the sequence fields (from `state` to `first_scheduled_s`, and the stop
    rules: admission, feeding, preemption, release); Scheduler.apply() appends generated
    tokens and stamps `first_token_s` and `finish_s`. Nothing else writes a Request.

    A running request feeds `token_ids[num_computed_tokens:]`: prefill, chunked
    prefill, prefix hits, recompute after preemption and decode are all "give it n
    more tokens". Every admission names a fresh sequence (`seq_id`) on the worker.
    """

    request_id: str
    sampling: SamplingParams
    stopping: ValidStopping
    priority: int
    num_prompt_tokens: int
    # Prompt then generated tokens (token_array()). Generated tokens are streamed
    # exactly once, when appended, so a recompute after preemption never repeats one.
    token_ids: array[int]
    arrival_s: float
    tenant: str = ""  # its tenant's name (core/tenants.py)
    deadline_s: float = math.inf  # when its caller stops waiting (ValidRequest.time_limit_s)
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
    cache_root_hash: int = ROOT_HASH  # the chain's root: kv.cache_root_hash(cache salt)
    admit_order: int = 0  # stamp of the latest admission; preemption picks the latest
    admit_step: int = -1  # step_id of the latest admission (fair preemption spares recent)
    last_scheduled_step: int = -1  # step_id of the last plan that fed this request
    num_cached_prompt_tokens: int | None = None  # prefix hit at first admission
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    # The stop rules as two plain fields (set_stop_rules, by the planner at each admission
    # since they depend on the worker): the ids that end it (its stop ids, and EOS unless
    # ignore_eos; also the worker's min_new_tokens mask), and the length (prompt plus
    # generated) at which it ends: max_new_tokens or a full context. Empty until admitted.
    stop_token_ids: frozenset[int] = frozenset()
    max_num_tokens: int = 0
    grammar: Grammar | None = None  # ValidRequest.grammar
    # A sample of an n > 1 request: its full blocks are keyed and matched even with prefix
    # caching off (then under a root hash private to the request's samples), so the
    # samples share the prompt's blocks by reference count whatever the setting.
    shares_prompt: bool = False
    # While HELD: the sample 0 whose prompt blocks it waits for; None once queued.
    prompt_leader: Request | None = None
    # Speculation: its drafts kept and tried, faded per step (speculation.acceptance), and
    # its pause after drafts that were not worth their price: no drafts before
    # drafts_resume_step, a pause twice as long next time until one is kept. The step
    # whose drafts its grammar forced: those say nothing of its n-gram drafts' chances,
    # so they stay out of the record.
    num_kept_drafts: float = 0.0
    num_tried_drafts: float = 0.0
    draft_pause_steps: int = 0
    drafts_resume_step: int = 0
    forced_drafts_step: int = -1

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_to_feed(self) -> int:
        """Tokens still to compute before the next sample (1 when decoding)."""
        return len(self.token_ids) - self.num_computed_tokens


def check_stop(request: Request, token_id: int) -> FinishReason | None:
    """How `token_id`, just appended to `request.token_ids`, ends the admitted request by its
    id and the lengths alone: STOP for one of its stop_token_ids (EOS among them unless
    ignore_eos), LENGTH at max_new_tokens or a full context (max_num_tokens), else None.
    Stop strings are the service's output processor's. A stop token's id is returned to
    the client, its text is not.

    min_new_tokens is not checked here: the worker masks these ids out of the logits until
    then (NewSequence.min_tokens_banned_ids, as transformers' and vLLM's min_new_tokens),
    and a worker that does not speaks an older protocol version and is refused. A
    second rule here would only hide a worker that broke the contract, by feeding back
    a token the model was told it could not produce.

    Two reads of the request itself, as vLLM's: its stopping rules (another object per
    request, a memory miss per token at hundreds running) are read once, at admission.
    """
    if token_id in request.stop_token_ids:
        return FinishReason.STOP
    if len(request.token_ids) >= request.max_num_tokens:
        return FinishReason.LENGTH
    return None


class QueueFullError(Exception):
    """The waiting queue is at max_waiting_requests (RESOURCE_EXHAUSTED)."""


class RequestTooLargeError(ValueError):
    """Prompt plus max_new_tokens can never fit the context or the whole KV pool."""


class DuplicateRequestError(ValueError):
    """A request with this id is already queued or running."""


def too_large_reason(
    num_prompt_tokens: int, max_new_tokens: int, geometry: WorkerGeometry
) -> str | None:
    """Why a request can never run on this worker, as a sentence; None if it can."""
    num_tokens = num_prompt_tokens + max_new_tokens
    if num_tokens > geometry.max_context_tokens:
        return (
            f"prompt ({num_prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) "
            f"exceeds the context of {geometry.max_context_tokens} tokens"
        )
    # The last generated token is never fed, so it needs no KV slot.
    num_blocks = -(-(num_tokens - 1) // geometry.block_size)
    if num_blocks > geometry.num_kv_blocks:
        return (
            f"prompt ({num_prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) needs "
            f"{num_blocks} KV blocks of {geometry.block_size} tokens but the worker's pool "
            f"holds {geometry.num_kv_blocks}"
        )
    return None


def set_stop_rules(
    request: Request, eos_token_ids: frozenset[int], max_context_tokens: int
) -> None:
    """Set the request's stop_token_ids and max_num_tokens (see Request) for a worker of
    these EOS ids and context."""
    stopping = request.stopping
    request.max_num_tokens = min(
        request.num_prompt_tokens + stopping.max_new_tokens, max_context_tokens
    )
    if stopping.ignore_eos:
        request.stop_token_ids = stopping.stop_token_ids
    elif stopping.stop_token_ids:
        request.stop_token_ids = stopping.stop_token_ids | eos_token_ids
    else:
        request.stop_token_ids = eos_token_ids  # one set for most requests: stays cached
