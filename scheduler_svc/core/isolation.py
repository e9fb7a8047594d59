"""Finding the poison request when a whole worker step fails.

A step that raises in the worker's forward, or during which the worker is lost (it died
or hung), names no culprit. Its requests become suspects, and are run in groups that
halve on failure (bisection):
- a failed step's requests split into two groups, tried first; a group runs alone
  (nothing else is fed beside it), as many of it as the free blocks hold; a request that
  samples a token in a group step that succeeds is cleared;
- a group step that fails splits what it fed in two again;
- a request that fails by itself (a group of one, or a step that fed only it)
  SOLO_FAILURES_TO_CONVICT times in a row is the culprit: it ends with ERROR (one solo
  failure may be a passing fault);
- when none of a group fits the free blocks, it waits for the running requests to free
  some (ordinary steps admit only what waits ahead of the suspects meanwhile); when only
  suspects run, its first request gets room by preempting others (a lone request always
  fits).
So one culprit among N suspects costs about log2 N + 2 failed steps (the halvings, then
two alone), and a benign loss (a worker that died of something else; the requests
handed over when a lane loses its worker) a few group steps rather than N solo ones.

Steps alternate: after each group step comes an ordinary one for every request that is
not a suspect (running, or waiting: admitted as usual), so their streams go on while
suspects are isolated; only requests of a group ever share a step. A request preempted
meanwhile goes before the next group, as in the queue, unless that group is halfway
through a prompt: it holds blocks that the others may need to finish.

Suspects and solo failures survive a new worker's hello: a request that killed the last
worker would kill the next one too. Called only from the Scheduler; the planner does the
planning (`Planner.plan(..., only=...)`), this module keeps the suspects.
"""

from __future__ import annotations

import math
from collections import deque

from pagoda.scheduler_svc.core.plan_builder import BuiltPlan
from pagoda.scheduler_svc.core.planner import Planner
from pagoda.scheduler_svc.core.request import Request, RequestState

SOLO_FAILURES_TO_CONVICT = 2


class Isolation:
    def __init__(self, requests: dict[str, Request], planner: Planner) -> None:
        self._requests = requests  # the Scheduler's, read only
        self._planner = planner
        # Suspect request ids, group by group: the first group runs next. Finished or
        # cancelled ones are dropped when their group comes up.
        self._groups: deque[list[str]] = deque()
        self._target: list[Request] | None = None  # the group the plan in flight runs
        self._generated_at_start: list[int] = []  # of each of the target's requests
        self._solo_failures: dict[str, int] = {}
        self._ordinary_turn = False  # the next step is an ordinary one, if it has work
        self._waiting_for_room = False  # the first group could not start for lack of blocks

    @property
    def active(self) -> bool:
        return bool(self._groups)

    @property
    def target(self) -> list[Request] | None:
        """The suspects the plan in flight runs alone, if any."""
        return self._target

    def plan(
        self, step_id: int, now: float, max_prefill_tokens: int | None
    ) -> tuple[BuiltPlan, bool]:
        """The next step while suspects are left, and whether it is a group step: every
        other step an ordinary one (`max_prefill_tokens`: the step budget's cap) when it
        has work, else the next group of suspects, alone, with room made for one of them
        if none fits. The plan may feed nothing (the caller then skips the step)."""
        group = self._next_group()
        # A request preempted by the others' growth waits ahead of the suspects: it goes
        # first, as in the queue; not ahead of a group halfway through a prompt, which
        # holds its blocks until it goes on (the others could wait for them forever).
        started = group is not None and _holds_blocks(group)
        tried_ordinary = self._ordinary_turn or (self._other_first_in_queue() and not started)
        self._ordinary_turn = False
        if tried_ordinary:
            built = self._ordinary(step_id, now, max_prefill_tokens)
            if built.plan.seq_ids:
                return built, False
        if group is not None:
            built = self._planner.plan(step_id, now, only=group)
            if not built.plan.seq_ids and not self._others(waiting=False):
                # None of it fits, and no request but suspects runs to free blocks: room
                # for the first (suspects of other groups may hold the blocks).
                group = group[:1]
                self._make_room(group[0])
                built = self._planner.plan(step_id, now, only=group)
            # Until the group starts, ordinary steps admit only what waits ahead of the
            # suspects (preempted requests): the blocks that the running requests free go
            # to the suspects before newer requests.
            self._waiting_for_room = not built.plan.seq_ids
            if built.plan.seq_ids:
                self._target = group
                self._generated_at_start = [r.num_generated_tokens for r in group]
                self._ordinary_turn = True
                return built, True
        if tried_ordinary:
            return built, False  # nothing can run
        return self._ordinary(step_id, now, max_prefill_tokens), False

    def cleared(self) -> None:
        """The isolated step succeeded: each of its requests that sampled a token (or
        finished) is innocent; the others stay in their group."""
        group, self._target = self._target, None
        if group is None:
            return
        innocent = {
            request.request_id
            for request, start in zip(group, self._generated_at_start, strict=True)
            if request.state is RequestState.FINISHED or request.num_generated_tokens > start
        }
        for request_id in innocent:
            self._solo_failures.pop(request_id, None)
        self._drop(innocent)

    def stand_down(self) -> None:
        """The suspects could not run this step (or their worker is gone); the next plan
        tries again."""
        self._target = None

    def failed(self, request_ids: list[str]) -> str | None:
        """A step that fed `request_ids` failed as a whole (it raised, or lost the worker):
        they are suspects, in two groups tried first. One that failed alone is tried alone
        again, and returned once convicted (it is no suspect any more); else None."""
        request_ids = list(dict.fromkeys(request_ids))
        self._target = None
        self._drop(set(request_ids))
        if len(request_ids) != 1:
            self._groups.extendleft(reversed(_halves(request_ids)))
            return None
        request_id = request_ids[0]
        failures = self._solo_failures.get(request_id, 0) + 1
        if failures >= SOLO_FAILURES_TO_CONVICT:
            self._solo_failures.pop(request_id, None)
            return request_id
        self._solo_failures[request_id] = failures
        self._groups.appendleft([request_id])
        return None

    def hand_over(self) -> list[tuple[str, int]]:
        """The suspects in order with their solo failures, forgotten here: their requests
        move to another worker's scheduler (Scheduler.hand_over)."""
        suspects = [
            (request_id, self._solo_failures.get(request_id, 0))
            for group in self._groups
            for request_id in group
        ]
        self._groups.clear()
        self._solo_failures.clear()
        self._target = None
        return suspects

    def take_over(self, suspects: list[tuple[str, int]]) -> None:
        """Suspects handed over by another scheduler's isolation, after those here: one
        that failed alone runs alone first; the others were lost together and are halved."""
        together = []
        for request_id, num_failures in suspects:
            if num_failures:
                self._solo_failures[request_id] = num_failures
                self._groups.append([request_id])
            else:
                together.append(request_id)
        self._groups.extend(_halves(together))

    def _ordinary(self, step_id: int, now: float, max_prefill_tokens: int | None) -> BuiltPlan:
        """A step for the requests that are not suspects (all once none is left)."""
        others = self._others() if self._groups else None
        return self._planner.plan(step_id, now, others, max_prefill_tokens=max_prefill_tokens)

    def _make_room(self, request: Request) -> None:
        """Preempt the latest-admitted others until `request`'s whole sequence fits (and
        it may start under max_active_requests), so a plan feeding it alone never has to
        preempt."""
        planner = self._planner
        blocks = planner.blocks
        assert blocks is not None
        needed = math.ceil((len(request.token_ids) + 1) / blocks.block_size) - len(
            request.block_ids
        )
        others = [r for r in planner.running.values() if r is not request]
        max_others = planner.config.max_active_requests - 1
        while (blocks.num_available_blocks < needed or len(others) > max_others) and others:
            planner.preempt(others.pop())

    def _others(self, *, waiting: bool = True) -> list[Request]:
        """The requests that are not suspects: running ones, then, with `waiting`, waiting
        ones in queue order (only those ahead of every suspect while a group waits for
        room)."""
        planner = self._planner
        suspects = {request_id for group in self._groups for request_id in group}
        others = [r for r in planner.running.values() if r.request_id not in suspects]
        if waiting:
            for request in planner.waiting:
                if request.request_id not in suspects:
                    others.append(request)
                elif self._waiting_for_room:
                    break
        return others

    def _other_first_in_queue(self) -> bool:
        head = self._planner.waiting.head(1)
        return bool(head) and not any(head[0].request_id in group for group in self._groups)

    def _next_group(self) -> list[Request] | None:
        """The first group's unfinished requests (empty groups dropped); None when no
        suspect is left."""
        groups, requests = self._groups, self._requests
        while groups:
            group = [requests[r] for r in groups[0] if r in requests]
            if group:
                groups[0] = [request.request_id for request in group]
                return group
            groups.popleft()
        return None

    def _drop(self, request_ids: set[str]) -> None:
        """Take `request_ids` out of their groups (empty groups go when they come up)."""
        for index, group in enumerate(self._groups):
            if any(request_id in request_ids for request_id in group):
                self._groups[index] = [r for r in group if r not in request_ids]


def _holds_blocks(group: list[Request]) -> bool:
    """A request of `group` runs: it holds blocks between the group's steps."""
    return any(request.state is RequestState.RUNNING for request in group)


def _halves(request_ids: list[str]) -> list[list[str]]:
    """`request_ids` in two groups (one if it has fewer than two)."""
    if len(request_ids) < 2:
        return [request_ids] if request_ids else []
    half = (len(request_ids) + 1) // 2
    return [request_ids[:half], request_ids[half:]]
