"""The scheduler core: schedule() returns a StepDecision, apply() turns the worker's
StepOutcome into events. No I/O and no clock: `now` (seconds, monotonic) is passed in.

One decision is in flight at a time: schedule() is called again only after apply() or
fail_step() of the previous one. add() and cancel() may be called at any time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagoda.scheduler_svc.core.config import SchedulerConfig
from pagoda.scheduler_svc.core.generation import accept_token, final_text, token_logprob
from pagoda.scheduler_svc.core.isolation import Isolation
from pagoda.scheduler_svc.core.request import (
    FinishReason,
    Request,
    RequestOutput,
    RequestState,
    TokenLogprob,
    ValidRequest,
    token_array,
)
from pagoda.scheduler_svc.core.request_limits import (
    DuplicateRequestError,
    QueueFullError,
    RequestTooLargeError,
    too_large_reason,
)
from pagoda.scheduler_svc.core.sequence_state import SequenceState
from pagoda.scheduler_svc.core.stats import SchedulerStats
from pagoda.scheduler_svc.core.step_decision import (
    NewSequenceSpec,
    StepDecision,
    StepOutcome,
    WorkerGeometry,
)
from pagoda.scheduler_svc.core.step_events import StepEvents
from pagoda.scheduler_svc.core.step_planner import StepPlanner
from pagoda.scheduler_svc.core.stop_rules import StopStringMatcher

if TYPE_CHECKING:
    from pagoda.scheduler_svc.detokenizer import IncrementalDetokenizer

__all__ = [
    "DuplicateRequestError",
    "NewSequenceSpec",
    "QueueFullError",
    "RequestTooLargeError",
    "Scheduler",
    "SchedulerStats",
    "StepDecision",
    "StepEvents",
    "StepOutcome",
    "WorkerGeometry",
]

_RUNNING = RequestState.RUNNING
_WAITING = RequestState.WAITING
_STOP = FinishReason.STOP


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        detokenizer_factory: Callable[[], IncrementalDetokenizer],
    ) -> None:
        config.validate()
        self.config = config
        self._new_detokenizer = detokenizer_factory
        self._state = SequenceState(config)
        self._planner = StepPlanner(self._state)
        self._isolation = Isolation(self._state, self._planner)
        self._in_flight: StepDecision | None = None
        self._step_ids = itertools.count(1)
        self._last_now = 0.0  # for events of calls that carry no clock (attach_worker)
        self._num_steps = 0
        self._num_requests_finished = 0
        self._num_generated_tokens = 0

    # -- worker lifecycle ------------------------------------------------------------------

    @property
    def worker_attached(self) -> bool:
        return self._state.blocks is not None

    def attach_worker(self, geometry: WorkerGeometry) -> list[RequestOutput]:
        """A worker said hello: a fresh pool and prefix cache; running requests recompute.

        Returns the finishing events of waiting requests this worker can never hold (its
        context or pool is smaller than the last one's); usually empty.
        """
        state = self._state
        if self.worker_attached:
            self.detach_worker()
        self._isolation.reset()
        state.attach_pool(geometry)
        outputs = []
        for request in list(state.waiting):
            reason = too_large_reason(
                request.num_prompt_tokens, request.stopping.max_new_tokens, geometry
            )
            if reason is not None:
                state.waiting.remove(request)
                outputs.append(self._finish_with_error(request, reason, self._last_now))
        return outputs

    def detach_worker(self) -> None:
        """The worker is lost: schedule() returns None until the next attach_worker()."""
        self._in_flight = None
        self._state.drop_pool()

    # -- requests in and out -----------------------------------------------------------------

    def add(self, request: ValidRequest, now: float) -> None:
        """Queue a validated request.

        Raises QueueFullError, RequestTooLargeError (checked against the last worker's
        geometry; before any worker, at its attach), DuplicateRequestError.
        """
        self._last_now = now
        state = self._state
        if request.request_id in state.requests:
            raise DuplicateRequestError(f"request_id {request.request_id!r} is already in flight")
        if len(state.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_waiting_requests} requests); "
                "retry later"
            )
        if not request.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if state.geometry is not None:
            reason = too_large_reason(
                len(request.prompt_token_ids), request.stopping.max_new_tokens, state.geometry
            )
            if reason is not None:
                raise RequestTooLargeError(reason)
        stop_strings = request.stopping.stop_strings
        detokenizer = self._new_detokenizer()
        queued = Request(
            request_id=request.request_id,
            sampling=request.sampling,
            stopping=request.stopping,
            priority=request.priority,
            num_prompt_tokens=len(request.prompt_token_ids),
            token_ids=token_array(request.prompt_token_ids),
            arrival_s=now,
            detokenizer=detokenizer,
            stop_matcher=StopStringMatcher(stop_strings) if stop_strings else None,
            last_token_id=request.prompt_token_ids[-1],
            whole_texts=detokenizer.whole_texts,
        )
        state.requests[request.request_id] = queued
        state.waiting.push_back(queued)

    def cancel(
        self,
        request_id: str,
        now: float,
        reason: FinishReason = FinishReason.CANCELLED,
        message: str | None = None,
    ) -> RequestOutput | None:
        """End a request now; its blocks are free at once and its sequence is forgotten by
        the next decision. None if it is unknown or already finished."""
        self._last_now = now
        request = self._state.requests.get(request_id)
        if request is None:
            return None
        if request.state is _WAITING:
            self._state.waiting.remove(request)
        return self._finish(request, reason, now, final_text(request), message=message)

    def has_work(self) -> bool:
        return bool(self._state.waiting) or bool(self._state.running)

    # -- one step ----------------------------------------------------------------------------

    def schedule(self, now: float) -> StepDecision | None:
        """Plan the next step, or None when there is nothing to run or no worker."""
        self._last_now = now
        state = self._state
        if state.blocks is None or not (state.running or state.waiting):
            return None
        if self._in_flight is not None:
            raise RuntimeError(
                f"schedule() while step {self._in_flight.step_id} is in flight; "
                "apply() or fail_step() it first"
            )
        step_id = next(self._step_ids)
        decision = self._isolation.plan(step_id, now) if self._isolation.active else None
        if decision is not None and not decision.seq_ids:
            self._isolation.stand_down()
            decision = None
        if decision is None:
            decision = self._planner.plan(step_id, now)
        if not decision.seq_ids:
            return None  # nothing could run (pending forgets wait for the next plan)
        decision.forget_seq_ids = state.forget_seq_ids
        state.forget_seq_ids = []
        self._in_flight = decision
        self._num_steps += 1
        return decision

    def apply(self, outcome: StepOutcome, now: float) -> StepEvents:
        """Take the worker's sampled tokens: stop rules, text, events. Finished requests free
        their blocks now and are forgotten by the next decision."""
        self._last_now = now
        state = self._state
        decision = self._in_flight
        events = StepEvents()
        if decision is None or outcome.step_id != decision.step_id:
            return events  # a late result of a step already failed or reset
        self._in_flight = None
        keyed = state.take_keyed_in_flight()
        outputs = events.outputs
        if outcome.step_error:
            outputs.extend(self._step_failed(decision, keyed, outcome.step_error, now))
            return events
        errors = outcome.errors
        if errors:
            state.unkey([(seq_id, block_id) for seq_id, block_id in keyed if seq_id in errors])
            for seq_id, message in errors.items():
                request = state.running.get(seq_id)
                if request is not None:
                    outputs.append(
                        self._finish_with_error(request, f"the worker failed it: {message}", now)
                    )
        if outcome.logprobs:
            self._take_tokens_with_logprobs(outcome, now, outputs)
        else:
            self._take_tokens(outcome, now, events)
        self._num_generated_tokens += len(outcome.seq_ids)
        if len(outcome.seq_ids) + len(errors) != decision.num_sampling:
            outputs.extend(self._finish_unsampled(decision, outcome, now))
        if self._isolation.target is not None:
            self._isolation.cleared()
        return events

    def _step_failed(
        self, decision: StepDecision, keyed: list[tuple[int, int]], error: str, now: float
    ) -> list[RequestOutput]:
        """The worker forgot every sequence the plan named: all are recomputed, the requests
        of a failed group each first alone (isolation.py); one that keeps failing alone is
        the culprit and ends with ERROR, so a poison request harms no other."""
        state = self._state
        state.unkey(keyed)
        request_ids = [state.running[s].request_id for s in decision.seq_ids if s in state.running]
        state.requeue(decision.seq_ids, worker_knows=False)
        if len(request_ids) != 1:
            self._isolation.suspect(request_ids)
            return []
        if not self._isolation.failed_alone(request_ids[0]):
            return []
        culprit = state.requests[request_ids[0]]
        if culprit.state is _WAITING:
            state.waiting.remove(culprit)
        return [
            self._finish_with_error(culprit, f"the worker failed on this request: {error}", now)
        ]

    def _take_tokens(self, outcome: StepOutcome, now: float, events: StepEvents) -> None:
        """The hot loop of apply(): one sampled token per running request, no logprobs.

        A token inside its request's steady window (Request.steady_from) that is not one
        of its ending token ids can only end the request by a stop string: it takes the
        short way. Any other token goes through accept_token's whole set of rules.
        """
        geometry = self._state.geometry
        eos_token_ids, max_context_tokens = geometry.eos_token_ids, geometry.max_context_tokens
        running = self._state.running
        request_ids, texts, token_ids = events.request_ids, events.texts, events.token_ids
        outputs = events.outputs
        # Exceptions rather than tests for the rare cases: a try costs nothing in 3.11.
        for seq_id, token_id in zip(outcome.seq_ids, outcome.token_ids, strict=True):
            try:
                request = running[seq_id]
            except KeyError:
                continue  # cancelled while the step ran
            num_tokens = len(request.token_ids) + 1  # with this one
            if (
                request.steady_from <= num_tokens < request.steady_until
                and token_id not in request.ending_token_ids
            ):
                request.token_ids.append(token_id)
                request.last_token_id = token_id
                # The detokenizer's common case without the call (~8% of a step here).
                try:
                    text = request.whole_texts[token_id]  # ids are unsigned on the wire
                except IndexError:
                    text = None  # a character is partial, or the id is beyond the table
                if text is None:
                    detokenizer = request.detokenizer
                    text = detokenizer.push(token_id)
                    request.whole_texts = detokenizer.whole_texts
                matcher = request.stop_matcher
                finish_reason = None
                # The matcher's common case without the call: nothing held, and nothing
                # in the text can start a stop string.
                if matcher is not None and (matcher.held_text or matcher.trigger in text):
                    text, stopped = matcher.push(text, True)
                    finish_reason = _STOP if stopped else None
            else:
                text, finish_reason = accept_token(
                    request, token_id, eos_token_ids, max_context_tokens
                )
                if request.first_token_s is None:
                    request.first_token_s = now
            if finish_reason is None:
                request_ids.append(request.request_id)
                texts.append(text)
                token_ids.append(token_id)
            else:
                outputs.append(self._finish(request, finish_reason, now, text, [token_id]))

    def _take_tokens_with_logprobs(
        self, outcome: StepOutcome, now: float, outputs: list[RequestOutput]
    ) -> None:
        geometry = self._state.geometry
        for index, seq_id in enumerate(outcome.seq_ids):
            request = self._state.running.get(seq_id)
            if request is None:
                continue
            token_id = outcome.token_ids[index]
            text, finish_reason = accept_token(
                request, token_id, geometry.eos_token_ids, geometry.max_context_tokens
            )
            if request.first_token_s is None:
                request.first_token_s = now
            logprobs = [token_logprob(outcome, index)] if request.sampling.num_logprobs else None
            if finish_reason is None:
                outputs.append(RequestOutput(request.request_id, text, [token_id], logprobs))
            else:
                outputs.append(
                    self._finish(request, finish_reason, now, text, [token_id], logprobs)
                )

    def fail_step(self, decision: StepDecision, error: str, now: float) -> list[RequestOutput]:
        """The worker was lost or timed out during `decision`: its sequences go back to the
        waiting queue for recompute; nothing streamed is lost or repeated."""
        self._last_now = now
        if self._in_flight is None or self._in_flight.step_id != decision.step_id:
            return []
        self._in_flight = None
        state = self._state
        state.unkey(state.take_keyed_in_flight())
        # The plan may never have arrived: send its forgets again (a worker ignores
        # forgets of sequences it does not hold).
        state.forget_seq_ids.extend(decision.forget_seq_ids)
        state.requeue(decision.seq_ids, worker_knows=True)
        return []

    @property
    def stats(self) -> SchedulerStats:
        state = self._state
        blocks = state.blocks
        queried = state.num_prefix_query_tokens
        return SchedulerStats(
            num_waiting=len(state.waiting),
            num_running=len(state.running),
            num_kv_blocks_used=blocks.allocator.num_used_blocks if blocks else 0,
            num_kv_blocks_total=blocks.allocator.num_total_blocks if blocks else 0,
            num_kv_blocks_cached=blocks.num_cached_free_blocks if blocks else 0,
            prefix_cache_hit_rate=state.num_prefix_hit_tokens / queried if queried else 0.0,
            num_preemptions=state.num_preemptions,
            num_steps=self._num_steps,
            num_requests_finished=self._num_requests_finished,
            num_generated_tokens=self._num_generated_tokens,
            num_prefix_queries_tokens=queried,
            num_prefix_hit_tokens=state.num_prefix_hit_tokens,
        )

    # -- finishing ----------------------------------------------------------------------------

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        now: float,
        text: str = "",
        token_ids: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
        message: str | None = None,
    ) -> RequestOutput:
        """The one finish path: blocks released, the request forgotten, the last event."""
        if request.state is _RUNNING:
            self._state.release_sequence(request)
        request.state = RequestState.FINISHED
        request.finish_s = now
        del self._state.requests[request.request_id]
        self._num_requests_finished += 1
        return RequestOutput(
            request_id=request.request_id,
            text=text,
            token_ids=token_ids if token_ids is not None else [],
            logprobs=logprobs,
            finish_reason=reason,
            error_message=message,
            usage=request.usage(),
            timings=request.timings(),
        )

    def _finish_with_error(self, request: Request, message: str, now: float) -> RequestOutput:
        return self._finish(request, FinishReason.ERROR, now, final_text(request), message=message)

    def _finish_unsampled(
        self, decision: StepDecision, outcome: StepOutcome, now: float
    ) -> list[RequestOutput]:
        """Sequences that should have sampled but got neither a token nor an error."""
        answered = set(outcome.seq_ids) | set(outcome.errors)
        outputs = []
        for seq_id, sampled in zip(decision.seq_ids, decision.sample, strict=True):
            request = self._state.running.get(seq_id)
            if sampled and seq_id not in answered and request is not None:
                outputs.append(
                    self._finish_with_error(request, "the worker returned no token for it", now)
                )
        return outputs
