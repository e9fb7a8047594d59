"""What every engine (paged or dummy) is to the server, and the step skeleton they share.

An engine turns one plain StepPlan into one StepResult (pagoda.gpu_worker.step; the
server's codec converts them to and from the wire). The shared skeleton admits the
plan into the sequence table, runs the engine's compute over the valid chunks,
forgets what the plan says to forget, and packs the result; an exception in the
compute becomes `step_error` and every sequence the plan named is forgotten.
Imports no torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pagoda.gpu_worker.sequence_table import AdmittedPlan, ScheduledChunk, SequenceTable
from pagoda.gpu_worker.step import StepPlan, StepResult

from pagoda.common.plan_check import PlanError

log = logging.getLogger("pagoda.worker.step")

MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the hello announces."""

    model_id: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context_tokens: int
    block_size: int
    num_kv_blocks: int
    device: str
    dtype: str
    max_logprobs: int = MAX_LOGPROBS


@dataclass(slots=True)
class SampledTokens:
    """One entry per chunk that samples, in plan order."""

    token_ids: list[int]
    # Filled only when some sequence asked for logprobs; then one entry per token.
    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    forward_ms: float = 0.0
    sample_ms: float = 0.0


class StepEngine(Protocol):
    facts: EngineFacts
    table: SequenceTable

    def step(self, plan: StepPlan) -> StepResult: ...

    def reset(self) -> None: ...


class InjectedFault(RuntimeError):
    """Raised by the --fail-on-token-id test hook."""


def check_injected_fault(chunks: list[ScheduledChunk], fail_on_token_id: int | None) -> None:
    if fail_on_token_id is None:
        return
    if any(fail_on_token_id in chunk.token_ids for chunk in chunks):
        raise InjectedFault(f"fault injected: token {fail_on_token_id} was fed")


def one_line(exc: Exception, max_chars: int = 300) -> str:
    """The exception as one bounded line (torch messages can span many)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def execute_plan(
    table: SequenceTable,
    plan: StepPlan,
    compute: Callable[[list[ScheduledChunk]], SampledTokens],
) -> StepResult:
    """Admit, compute, forget, pack. Never raises for a bad plan or a failing forward."""
    started_s = time.perf_counter()
    try:
        admitted = table.admit(plan)
        sampled = compute(admitted.chunks) if admitted.chunks else SampledTokens([])
    except Exception as exc:  # any failure in the forward must not kill the worker
        ids = sorted(plan.named_seq_ids())
        table.forget(ids)
        message = one_line(exc)
        log.warning("step %d failed: %s; forgot %d sequences", plan.step_id, message, len(ids))
        if not isinstance(exc, PlanError):
            log.debug("step %d traceback", plan.step_id, exc_info=True)
        return StepResult(
            step_id=plan.step_id,
            step_error=message,
            total_ms=(time.perf_counter() - started_s) * 1e3,
        )
    table.forget(admitted.forget_seq_ids)
    result = pack_result(admitted, sampled)
    result.total_ms = (time.perf_counter() - started_s) * 1e3
    return result


def pack_result(admitted: AdmittedPlan, sampled: SampledTokens) -> StepResult:
    result = StepResult(
        step_id=admitted.step_id,
        seq_ids=[chunk.seq.seq_id for chunk in admitted.chunks if chunk.sample],
        token_ids=sampled.token_ids,
        errors=admitted.refusals,
        forward_ms=sampled.forward_ms,
        sample_ms=sampled.sample_ms,
        num_tokens=admitted.num_tokens,
    )
    if sampled.logprobs:
        result.logprobs = sampled.logprobs
        result.top_offsets.append(0)
        for ids, logprobs in zip(sampled.top_token_ids, sampled.top_logprobs, strict=True):
            result.top_token_ids.extend(ids)
            result.top_logprobs.extend(logprobs)
            result.top_offsets.append(len(result.top_token_ids))
    return result
