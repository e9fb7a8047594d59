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

A step is two halves, `launch` (admit, enqueue the forward and sampling, forget) and
`read` (wait for the sampled tokens, record them, pack); `step` is one then the other.
An engine whose `launch_compute` enqueues device work without waiting (the paged engine
on CUDA) may launch step N+1 before N is read (`launches_ahead`, `can_launch_ahead`):
N+1's placeholder rows then feed N's tokens on the device, where N sampled them
(sequence_table.PENDING_TOKEN), so the device runs N+1 right after N while the host reads
N, answers it and admits N+2. At most one step is launched ahead; steps are read in
launch order. A step launched on top of one whose read fails fails too (its placeholders
fed tokens that never were).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

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
    # A row's logits never depend on its batch (Hello.batch_invariant): the CPU paths.
    batch_invariant: bool = False


@dataclass(slots=True)
class SampledTokens:
    """One entry per sample point (SequenceTable.sampling_rows: a row with d drafts has
    d + 1), in plan order."""

    token_ids: list[int]
    # Filled only when some sequence asked for logprobs; then one entry per token.
    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    forward_ms: float = 0.0
    sample_ms: float = 0.0


class PendingTokens(Protocol):
    """A compute's sampled tokens on their way to the host (Engine.launch_compute)."""

    def done(self) -> bool:
        """Whether `read` would return without waiting."""

    def read(self) -> SampledTokens:
        """The tokens (once): the step's one wait for its device."""


@dataclass(slots=True)
class ComputedTokens:
    """Tokens already on the host: an engine whose compute is done when it returns."""

    sampled: SampledTokens

    def done(self) -> bool:
        return True

    def read(self) -> SampledTokens:
        return self.sampled


@dataclass(slots=True, eq=False)
class Launched:
    """A step whose work is enqueued (Engine.launch); Engine.read answers it, once."""

    plan: StepPlan  # as received
    started_s: float
    # The step launched before this one and not read then (launched ahead: its tokens may
    # be fed here), or None.
    after: Launched | None
    admitted: StepPlan | None = None
    refusals: dict[int, str] = field(default_factory=dict)
    sampling: SamplingRows | None = None  # the admitted rows that sample
    tokens: PendingTokens | None = None  # None: nothing was computed
    failure: str | None = None  # why the step failed (at its launch or its read)

    def done(self) -> bool:
        """Whether reading it would not wait for the device."""
        return self.tokens is None or self.tokens.done()


class InjectedFault(RuntimeError):
    """Raised by the --fail-on-token-id test hook."""


class StepBeforeFailed(RuntimeError):
    """A step launched ahead of one whose read failed: its placeholders fed no real token."""


class Engine(ABC):
    """Runs step plans against one sequence table. Called only from the worker's step loop."""

    # Whether the server may launch a step before the one before it is read (see the module
    # docstring): the worker's --launch-ahead, for an engine whose launch_compute enqueues.
    launches_ahead = False

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
        self._unread: Launched | None = None  # the last step launched, until it is read
        self._last_read_s = 0.0  # when the last read ended (perf_counter)

    @abstractmethod
    def compute(self, plan: StepPlan) -> SampledTokens:
        """The forward and sampling over an admitted plan (at least one row); each row's
        sequence is in self.table."""

    def launch_compute(self, plan: StepPlan) -> PendingTokens:
        """`compute`, enqueued: an engine that can returns before its device is done (and
        then feeds the rows of `plan` that hold PENDING_TOKEN from the unread step's
        tokens); this one computes at once."""
        return ComputedTokens(self.compute(plan))

    def can_launch_ahead(self, plan: StepPlan) -> bool:
        """Whether `plan` (as received) may be launched while the last step launched is
        unread. Never a plan whose masks follow: they come once that step is answered."""
        return self.launches_ahead and not plan.masks_follow

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
            rows.masks.update(follow_up_masks(plan, masks, self.facts.vocab_size, rows))
        return rows

    def step(self, plan: StepPlan) -> StepResult:
        """Admit, compute, forget, pack. Never raises for a bad plan or a failing forward."""
        return self.read(self.launch(plan))

    def launch(self, plan: StepPlan) -> Launched:
        """Admit the plan, enqueue its compute, forget what it says to forget. Never raises:
        a failure is kept for `read` to answer."""
        launched = Launched(plan, time.perf_counter(), after=self._unread)
        try:
            admitted, refusals = self.table.admit(plan)
            launched.admitted, launched.refusals = admitted, refusals
            if admitted.seq_ids:
                self._check_injected_fault(admitted)
                launched.tokens = self.launch_compute(admitted)
                launched.sampling = self.table.sampling_rows(admitted, with_masks=False)
                # A plan launched before this one is read feeds these as placeholders.
                self.table.expect_sampled(launched.sampling)
        except Exception as exc:  # any failure in the forward must not kill the worker
            self._fail(launched, exc)
            return launched
        self.table.forget(admitted.forget_seq_ids)
        self._unread = launched
        return launched

    def read(self, launched: Launched) -> StepResult:
        """Wait for a launched step's tokens, record them, pack its result (steps are read
        in launch order)."""
        if self._unread is launched:
            self._unread = None
        after = launched.after
        launched.after = None  # else each step would keep every step before it alive
        if launched.failure is None and after is not None and after.failure is not None:
            self._fail(
                launched,
                StepBeforeFailed(
                    f"step {after.plan.step_id}, launched before it, failed: {after.failure}"
                ),
            )
        sampled = SampledTokens([])
        if launched.failure is None and launched.tokens is not None:
            try:
                sampled = launched.tokens.read()
                self.table.record_sampled(launched.sampling, sampled.token_ids)
            except Exception as exc:  # a device error surfaces at the wait
                self._fail(launched, exc)
        launched.tokens = None  # its device tensors: a step launched on it holds its own
        now_s = time.perf_counter()
        # Its own time: a step launched ahead waited for the one before it to be read.
        ahead = launched.started_s < self._last_read_s
        total_ms = (now_s - max(launched.started_s, self._last_read_s)) * 1e3
        self._last_read_s = now_s
        if ahead:  # the compute's clock ran from the launch: its rest is this step's too
            sampled.sample_ms = max(total_ms - sampled.forward_ms, 0.0)
        if launched.failure is not None:
            return StepResult(
                step_id=launched.plan.step_id, step_error=launched.failure, total_ms=total_ms
            )
        result = pack_result(launched.admitted, launched.refusals, sampled)
        result.total_ms = total_ms
        return result

    def _fail(self, launched: Launched, exc: Exception) -> None:
        """The step fails whole: every sequence it named is forgotten."""
        plan = launched.plan
        ids = sorted(plan.named_seq_ids())
        self.table.forget(ids)
        launched.failure = one_line(exc)
        log.warning(
            "step %d failed: %s; forgot %d sequences", plan.step_id, launched.failure, len(ids)
        )
        if not isinstance(exc, PlanError | StepBeforeFailed):
            log.debug("step %d traceback", plan.step_id, exc_info=exc)

    def reset(self) -> None:
        """Forget every sequence (a new scheduler knows none of them)."""
        self.table.clear()
        self._unread = None

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
        seq_ids=admitted.sampled_seq_ids(),
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
