"""Finding the poison request when a whole worker step fails.

A step that raises in the worker's forward, or during which the worker is lost (it died
or hung), names no culprit. Its requests become suspects; each is then run alone, one
step at a time, until it samples a token (cleared) or fails by itself
SOLO_FAILURES_TO_CONVICT times in a row (the culprit: it ends with ERROR; one solo
failure may be a passing fault). Everything else waits meanwhile, so the culprit harms
no other request. Suspects and solo failures survive a new worker's hello: a request
that killed the last worker would kill the next one too. Called only from the
Scheduler; the planner does the planning (`Planner.plan(..., only=request)`), this
module only keeps the suspects.
"""

from __future__ import annotations

from collections import deque

from pagoda.scheduler_svc.core.outputs import StepPlan
from pagoda.scheduler_svc.core.planner import Planner
from pagoda.scheduler_svc.core.request import Request, RequestState

SOLO_FAILURES_TO_CONVICT = 2


class Isolation:
    def __init__(self, requests: dict[str, Request], planner: Planner) -> None:
        self._requests = requests  # the Scheduler's, read only
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
        """The suspect the plan in flight runs alone, if any."""
        return self._target

    def suspect(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if request_id not in self._suspect_ids:
                self._suspect_ids.append(request_id)

    def plan(self, step_id: int, now: float) -> StepPlan | None:
        """A step that feeds only the first live suspect, with room made for its whole
        sequence; None when no suspect is left."""
        requests = self._requests
        while self._suspect_ids and self._suspect_ids[0] not in requests:
            self._suspect_ids.popleft()  # finished or cancelled meanwhile
        if not self._suspect_ids:
            return None
        request = requests[self._suspect_ids[0]]
        if self._target is not request:
            self._target = request
            self._generated_at_start = request.num_generated_tokens
        self._planner.make_room(request)
        return self._planner.plan(step_id, now, only=request)

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
        """The suspect could not run alone this step (or its worker is gone); the next plan
        is an ordinary one, or tries it again."""
        self._target = None

    def hand_over(self) -> list[tuple[str, int]]:
        """The suspects in order with their solo failures, forgotten here: their requests
        move to another worker's scheduler (Scheduler.hand_over)."""
        suspects = [(s, self._solo_failures.get(s, 0)) for s in self._suspect_ids]
        self._suspect_ids.clear()
        self._solo_failures.clear()
        self._target = None
        return suspects

    def take_over(self, suspects: list[tuple[str, int]]) -> None:
        """Suspects handed over by another scheduler's isolation, after those here."""
        for request_id, num_failures in suspects:
            self.suspect([request_id])
            if num_failures:
                self._solo_failures[request_id] = num_failures

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
