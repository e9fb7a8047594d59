"""What an engine is to the server, and the step every engine (paged or dummy) runs.

An engine turns one plain StepPlan into one StepResult (pagoda.common.step; the
server's step_codec converts them to and from the wire). `Engine.step` admits the plan into
the sequence table, runs the subclass's `compute` over the admitted plan (its valid
rows, still columns), forgets what the plan says to forget, and packs the result; an
exception in the compute becomes `step_error` and every sequence the plan named is
forgotten. A subclass supplies only its facts and its compute, which samples the rows
`Engine.sampling_rows` gives after its forward: a plan whose masks follow it
(StepPlan.masks_follow) waits there, and only there, for them (`wait_masks`, the
server's). Imports no torch.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from pagoda.common.plan_check import PlanError
from pagoda.common.step import StepMasks, StepPlan, StepResult
from pagoda.gpu_worker.sequence_table import SamplingRows, SequenceTable, follow_up_masks

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
    quantization: str = "none"  # "none" or "int8"
    numerics: str = ""  # in words: pagoda.gpu_worker.numerics.describe_numerics


@dataclass(slots=True)
class SampledTokens:
    """One entry per plan row that samples, in plan order."""

    token_ids: list[int]
    # Filled only when some sequence asked for logprobs; then one entry per token.
    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    forward_ms: float = 0.0
    sample_ms: float = 0.0


class InjectedFault(RuntimeError):
    """Raised by the --fail-on-token-id test hook."""


class Engine(ABC):
    """Runs step plans against one sequence table. Called only from the worker's step loop."""

    def __init__(self, facts: EngineFacts, *, fail_on_token_id: int | None = None) -> None:
        self.facts = facts
        self.fail_on_token_id = fail_on_token_id  # fault-injection hook for tests
        self.table = SequenceTable(
            num_kv_blocks=facts.num_kv_blocks,
            block_size=facts.block_size,
            vocab_size=facts.vocab_size,
            max_context_tokens=facts.max_context_tokens,
            max_logprobs=facts.max_logprobs,
        )
        # The StepMasks of a step id, waited for (the server's: it raises when they do
        # not come in time); None: no channel, a plan whose masks follow fails its step.
        self.wait_masks: Callable[[int], StepMasks] | None = None

    @abstractmethod
    def compute(self, plan: StepPlan) -> SampledTokens:
        """The forward and sampling over an admitted plan (at least one row); each row's
        sequence is in self.table."""

    def sampling_rows(self, plan: StepPlan) -> SamplingRows:
        """The admitted plan's rows that sample, with their masks: those that follow it
        (masks_follow) are waited for here, so call it after the forward, to sample."""
        rows = self.table.sampling_rows(plan)
        if plan.masks_follow:
            if self.wait_masks is None:
                raise RuntimeError(
                    f"the masks of step {plan.step_id} follow, but nothing brings them"
                )
            masks = self.wait_masks(plan.step_id)
            rows.masks.update(follow_up_masks(plan, masks, self.facts.vocab_size))
        return rows

    def step(self, plan: StepPlan) -> StepResult:
        """Admit, compute, forget, pack. Never raises for a bad plan or a failing forward."""
        started_s = time.perf_counter()
        try:
            admitted, refusals = self.table.admit(plan)
            if admitted.seq_ids:
                self._check_injected_fault(admitted)
                sampled = self.compute(admitted)
                # Before the next plan, which may feed these tokens as placeholders.
                self.table.record_sampled(admitted, sampled.token_ids)
            else:
                sampled = SampledTokens([])
        except Exception as exc:  # any failure in the forward must not kill the worker
            ids = sorted(plan.named_seq_ids())
            self.table.forget(ids)
            message = one_line(exc)
            log.warning("step %d failed: %s; forgot %d sequences", plan.step_id, message, len(ids))
            if not isinstance(exc, PlanError):
                log.debug("step %d traceback", plan.step_id, exc_info=True)
            return StepResult(
                step_id=plan.step_id,
                step_error=message,
                total_ms=(time.perf_counter() - started_s) * 1e3,
            )
        self.table.forget(admitted.forget_seq_ids)
        result = pack_result(admitted, refusals, sampled)
        result.total_ms = (time.perf_counter() - started_s) * 1e3
        return result

    def reset(self) -> None:
        """Forget every sequence (a new scheduler knows none of them)."""
        self.table.clear()

    def _check_injected_fault(self, plan: StepPlan) -> None:
        token_id = self.fail_on_token_id
        if token_id is not None and token_id in plan.token_ids:
            raise InjectedFault(f"fault injected: token {token_id} was fed")


def one_line(exc: Exception, max_chars: int = 300) -> str:
    """The exception as one bounded line (torch messages can span many)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def pack_result(admitted: StepPlan, refusals: dict[int, str], sampled: SampledTokens) -> StepResult:
    """The result of an admitted plan (SequenceTable.admit) and its refusals."""
    result = StepResult(
        step_id=admitted.step_id,
        seq_ids=[s for s, sample in zip(admitted.seq_ids, admitted.sample, strict=True) if sample],
        token_ids=sampled.token_ids,
        errors=refusals,
        forward_ms=sampled.forward_ms,
        sample_ms=sampled.sample_ms,
        num_tokens=len(admitted.token_ids),
    )
    if sampled.logprobs:
        result.logprobs = sampled.logprobs
        result.top_offsets.append(0)
        for ids, logprobs in zip(sampled.top_token_ids, sampled.top_logprobs, strict=True):
            result.top_token_ids.extend(ids)
            result.top_logprobs.extend(logprobs)
            result.top_offsets.append(len(result.top_token_ids))
    return result
