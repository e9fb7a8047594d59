"""Finding the poison request when a whole worker step fails.

A step that raises in the worker's forward names no culprit. Its requests become
suspects; each is then run alone, one step at a time, until it samples a token
(cleared) or fails by itself SOLO_FAILURES_TO_CONVICT times in a row (the culprit: it
ends with ERROR; one solo failure may be a passing fault). Everything else waits
meanwhile, so the culprit harms no other request. Called only from the Scheduler.
"""

from __future__ import annotations

import math
from collections import deque

from pagoda.scheduler_svc.core.request import Request, RequestState
from pagoda.scheduler_svc.core.sequence_state import SequenceState
from pagoda.scheduler_svc.core.step_decision import StepDecision
from pagoda.scheduler_svc.core.step_planner import StepPlanner
from pagoda.scheduler_svc.core.waiting_queue import WaitingQueue

SOLO_FAILURES_TO_CONVICT = 2


class Isolation:
    def __init__(self, state: SequenceState, planner: StepPlanner) -> None:
        self._state = state
        self._planner = planner
        self._suspect_ids: deque[str] = deque()
        self._target: Request | None = None
        self._generated_at_start = 0
        self._solo_failures: dict[str, int] = {}

    @property
    def active(self) -> bool:
        return bool(self._suspect_ids)

    @property
    def target(self) -> Request | None:
        """The suspect the decision in flight ran alone, if any."""
        return self._target

    def suspect(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if request_id not in self._suspect_ids:
                self._suspect_ids.append(request_id)

    def reset(self) -> None:
        """A new worker: the failure may have been the old worker's; start afresh."""
        self._suspect_ids.clear()
        self._solo_failures.clear()
        self._target = None

    def plan(self, step_id: int, now: float) -> StepDecision | None:
        """A step that feeds only the first live suspect; None when no suspect is left."""
        state = self._state
        while self._suspect_ids and self._suspect_ids[0] not in state.requests:
            self._suspect_ids.popleft()  # finished or cancelled meanwhile
        if not self._suspect_ids:
            return None
        request = state.requests[self._suspect_ids[0]]
        if self._target is not request:
            self._target = request
            self._generated_at_start = request.num_generated_tokens
        self._make_room(request)
        return self._plan_alone(request, step_id, now)

    def cleared(self) -> None:
        """The isolated step succeeded: the target is innocent once it sampled a token."""
        request = self._target
        if request is None:
            return
        done = request.state is RequestState.FINISHED
        if done or request.num_generated_tokens > self._generated_at_start:
            if self._suspect_ids and self._suspect_ids[0] == request.request_id:
                self._suspect_ids.popleft()
            self._solo_failures.pop(request.request_id, None)
            self._target = None

    def stand_down(self) -> None:
        """The suspect could not run alone this step; the next plan is an ordinary one."""
        self._target = None

    def failed_alone(self, request_id: str) -> bool:
        """A step feeding only `request_id` failed: True when it is now the convicted
        culprit, False when it stays first in line to be tried alone again."""
        failures = self._solo_failures.get(request_id, 0) + 1
        self._target = None
        if failures < SOLO_FAILURES_TO_CONVICT:
            self._solo_failures[request_id] = failures
            if request_id in self._suspect_ids:
                self._suspect_ids.remove(request_id)
            self._suspect_ids.appendleft(request_id)
            return False
        self._solo_failures.pop(request_id, None)
        if request_id in self._suspect_ids:
            self._suspect_ids.remove(request_id)
        return True

    def _make_room(self, request: Request) -> None:
        """Preempt the latest-admitted others until the suspect's whole sequence fits, so
        the planner never has to preempt inside the isolated view."""
        state = self._state
        blocks = state.blocks
        assert blocks is not None
        needed = math.ceil((len(request.token_ids) + 1) / blocks.block_size) - len(
            request.block_ids
        )
        others = [r for r in state.running.values() if r is not request]
        while blocks.num_available_blocks < needed and others:
            state.preempt(others.pop())

    def _plan_alone(self, request: Request, step_id: int, now: float) -> StepDecision:
        """Plan with the queues swapped for views holding only `request`, then merge back."""
        state = self._state
        waiting, running, prefilling = state.waiting, state.running, state.prefilling
        was_waiting = request.state is RequestState.WAITING
        view_waiting = WaitingQueue(by_priority=state.by_priority)
        if was_waiting:
            view_running: dict[int, Request] = {}
            view_prefilling: dict[int, Request] = {}
            view_waiting.push_back(request)
        else:
            view_running = {request.seq_id: request}
            view_prefilling = {request.seq_id: request} if request.seq_id in prefilling else {}
        state.waiting, state.running, state.prefilling = view_waiting, view_running, view_prefilling
        try:
            decision = self._planner.plan(step_id, now)
        finally:
            state.waiting, state.running, state.prefilling = waiting, running, prefilling
        if request.state is RequestState.RUNNING:
            if was_waiting:
                waiting.remove(request)
                running[request.seq_id] = request
            if request.seq_id in view_prefilling:
                prefilling[request.seq_id] = request
            else:
                prefilling.pop(request.seq_id, None)
        return decision
