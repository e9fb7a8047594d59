"""What the core hands out: the outputs of a step for clients and the scheduler's stats.

The plan of a step and the worker's result of it are pagoda.common.step's, shared with the
worker. Durations sent to clients are milliseconds (`*_ms`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from pagoda.common.step import StepResult
from pagoda.scheduler_svc.core.request import FinishReason, Request

# -- what clients get --------------------------------------------------------------------------


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call of one of a Chat request's tools, read from its output by the text stage."""

    id: str
    name: str
    arguments: str  # a JSON object's text


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int  # times preempted and recomputed
    # Of completion_tokens, a thinking model's thinking: counted at the service's edge
    # (scheduler_svc.reasoning), not by the core.
    reasoning_tokens: int = 0


@dataclass(slots=True)
class Timings:
    queued_ms: float  # arrival to first scheduled
    first_token_ms: float  # arrival to the first generated token
    total_ms: float  # arrival to finish


@dataclass(slots=True)
class RequestOutput:
    """One event to stream to a client: what is new since the previous event.

    The core leaves `text` empty; the service's output processor fills it with whole
    UTF-8 characters, holding back text that may begin a stop string.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # one per token in token_ids when asked for
    finish_reason: FinishReason | None = None
    error_message: str | None = None
    usage: Usage | None = None  # the finishing event only
    timings: Timings | None = None  # the finishing event only
    # The finishing event only: the calls of tools the text stage read in the output.
    tool_calls: tuple[ToolCall, ...] = ()
    # Tokens of a speculative step that a stop string ended before (the text stage took
    # them out of token_ids); the core drops them from the request (Scheduler.stop).
    num_dropped_tokens: int = 0


@dataclass(slots=True)
class StepOutputs:
    """What one apply() gives the clients, mostly column-wise.

    Nearly every output of a decode step is "request r got token t" (and, once the output
    processor ran, "may show text s"). Those are parallel columns rather than one
    RequestOutput each, so a step of 1,000 sequences builds a few lists instead of 1,000
    objects, and the output slots append to their pending columns. Everything else (a
    finish with its usage, a token with logprobs, an error) is a whole RequestOutput in
    `outputs`. A request appears at most once per step.
    """

    # Requests that got one token and go on: request_ids[i] got token_ids[i] and may show
    # texts[i] now ("" while a character or a possible stop string is incomplete). texts
    # is empty as apply() returns it; the service's output processor fills it.
    request_ids: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids) + len(self.outputs)

    def __iter__(self) -> Iterator[RequestOutput]:
        """Every output as a RequestOutput, the columns' first (for tests and tools; the
        service reads the columns)."""
        texts = self.texts or [""] * len(self.request_ids)
        for request_id, text, token_id in zip(self.request_ids, texts, self.token_ids, strict=True):
            yield RequestOutput(request_id, text, [token_id], None)
        yield from self.outputs


def token_logprob(result: StepResult, index: int) -> TokenLogprob:
    """The logprobs of the `index`-th sampled token of `result`."""
    top_offsets = result.top_offsets
    if len(top_offsets) > index + 1:
        start, end = top_offsets[index], top_offsets[index + 1]
        top_token_ids, top_logprobs = (
            result.top_token_ids[start:end],
            result.top_logprobs[start:end],
        )
    else:
        top_token_ids, top_logprobs = [], []
    return TokenLogprob(
        token_id=result.token_ids[index],
        logprob=result.logprobs[index],
        top_token_ids=top_token_ids,
        top_logprobs=top_logprobs,
    )


def usage_of(request: Request) -> Usage:
    return Usage(
        prompt_tokens=request.num_prompt_tokens,
        completion_tokens=request.num_generated_tokens,
        cached_prompt_tokens=request.num_cached_prompt_tokens or 0,
        num_preemptions=request.num_preemptions,
    )


def timings_of(request: Request) -> Timings:
    """Milliseconds since arrival, once finished; a stage never reached counts as the end."""
    assert request.finish_s is not None
    end_s = request.finish_s
    scheduled_s = request.first_scheduled_s if request.first_scheduled_s is not None else end_s
    first_token_s = request.first_token_s if request.first_token_s is not None else end_s
    return Timings(
        queued_ms=(scheduled_s - request.arrival_s) * 1000.0,
        first_token_ms=(first_token_s - request.arrival_s) * 1000.0,
        total_ms=(end_s - request.arrival_s) * 1000.0,
    )


# -- the scheduler about itself ----------------------------------------------------------------


@dataclass(slots=True)
class SchedulerStats:
    """What the scheduler reports about itself (GetServerStats, Prometheus)."""

    num_waiting: int
    num_running: int
    num_kv_blocks_used: int  # owned by running sequences
    num_kv_blocks_total: int
    num_kv_blocks_cached: int  # ownerless blocks kept for prefix reuse
    prefix_cache_hit_rate: float  # cached prompt tokens / prompt tokens looked up, in [0, 1]
    num_preemptions: int
    num_steps: int
    num_requests_finished: int
    num_generated_tokens: int
    num_prefix_queries_tokens: int  # prompt tokens looked up (first admissions only)
    num_prefix_hit_tokens: int
    # Speculation (speculation.py): drafted tokens fed, and those the model agreed with.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # Steps that fed one suspect alone, to find the request that made a step fail or
    # lost the worker (isolation.py).
    num_isolated_steps: int = 0
    # Prompt tokens the last planned step could carry: the fixed knobs, lowered by the step
    # budget when decodes were in it (target_step_ms).
    step_prefill_cap_tokens: int = 0
    # The step budget's cost model of the worker (0 while it is off or has not measured):
    # step_ms ~ intercept + per prefill token * tokens + per decode sequence * sequences
    #           + per context token * the sequences' contexts summed.
    step_cost_intercept_ms: float = 0.0
    step_cost_prefill_ms_per_token: float = 0.0
    step_cost_decode_ms_per_seq: float = 0.0
    step_cost_context_ms_per_token: float = 0.0
