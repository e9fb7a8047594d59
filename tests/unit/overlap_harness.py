"""A randomized run of the scheduler core as the overlapped step loop drives it (sched s3
review's harness): random knobs, tiny pools, shared prefixes, priorities, and at any
step a refused sequence, a failed step, a lost worker or a cancel.

After every apply it checks block ownership and, against the checking FakeWorker, that
every prefix-cache key not owned by a step in flight names a block holding exactly its
tokens' K/V (a garbage key is served to the next identical prompt). At the end every
natural end streamed exactly what the request gives alone, and cancels and errors a
prefix of it.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections import Counter, defaultdict, deque

from pagoda.scheduler_svc.core import FinishReason
from pagoda.scheduler_svc.core.request import (
    QueueFullError,
    Request,
    RequestTooLargeError,
    sample_request_ids,
)
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import (
    Stream,
    TextScheduler,
    check_invariants,
    expected_generation,
    make_geometry,
    make_request,
    make_scheduler,
)

EOS = 2
BLOCK_SIZE = 4


def random_knobs(rng: random.Random) -> dict:
    policy = rng.choice(["fifo", "pack", "priority"])
    knobs = dict(
        admission_policy=policy,
        max_num_batched_tokens=rng.choice([16, 24, 48, 128]),
        chunked_prefill=rng.random() < 0.7,
        decode_first=rng.random() < 0.6,
        prefix_caching=rng.random() < 0.85,
        max_active_requests=rng.choice([4, 8, 64]),
        max_waiting_requests=64,
        target_step_ms=rng.choice([None, None, 5.0, 50.0]),
    )
    if rng.random() < 0.3:
        knobs["max_decode_batch_size"] = rng.choice([1, 3, 8])
    if rng.random() < 0.3:
        knobs["prefill_max_tokens"] = rng.choice([8, 16, 40])
    if policy != "fifo" and rng.random() < 0.6:
        knobs["force_fifo_every"] = rng.choice([2, 3])
    return knobs


def run(
    seed: int,
    *,
    num_arrival_steps: int = 300,
    max_steps: int = 6000,
    p_refuse: float = 0.03,
    p_fail: float = 0.01,
    p_loss: float = 0.004,
    p_cancel: float = 0.03,
    overlap: bool = True,
    knob_overrides: dict | None = None,
    tenants: tuple[str, ...] = ("",),
    plans: list | None = None,
    max_n: int = 1,
) -> Counter:
    """One run; raises AssertionError (or the FakeWorker's PlanError) on a violation.
    Returns counts of what happened (finish reasons, refusals, fails, losses). Requests
    come from `tenants` in turn (weights 1, 2, 3...); each plan is appended to `plans`.
    With `max_n` above 1, a third of the requests ask for 2 to max_n samples, each
    sample streaming what the request gives alone."""
    rng = random.Random(seed)
    knobs = random_knobs(rng) | (knob_overrides or {})
    geometry = make_geometry(
        num_kv_blocks=rng.choice([14, 20, 32, 64]),
        block_size=BLOCK_SIZE,
        max_context_tokens=96,
        eos_token_ids=[EOS],
        vocab_size=100,
    )
    scheduler = make_scheduler(geometry, **knobs)
    worker = FakeWorker(geometry, overlapped=overlap)
    prefixes = [[rng.randrange(3, 99) for _ in range(rng.choice([4, 8, 9, 12]))] for _ in range(4)]
    streams: dict[str, Stream] = defaultdict(Stream)
    valid_requests = {}
    queued: list[Request] = []  # every request queued, for their block hashes
    live: set[str] = set()
    counts: Counter = Counter()
    in_flight: deque = deque()  # (result, doomed: the step after a failed one)

    def take(outputs) -> None:
        for output in outputs:
            streams[output.request_id].take(output)
            if output.finish_reason is not None:
                live.discard(output.request_id)
                counts[output.finish_reason.name] += 1

    for step in range(max_steps):
        now = float(step)
        if step < num_arrival_steps and rng.random() < 0.35:
            for _ in range(rng.choice([1, 1, 2, 3])):
                prefix = rng.choice(prefixes) if rng.random() < 0.7 else []
                tail = [rng.randrange(3, 99) for _ in range(rng.choice([0, 1, 3, 6, 13]))]
                request_id = f"q{len(valid_requests)}"
                request = make_request(
                    request_id,
                    prefix + tail or [5],
                    max_new_tokens=rng.choice([1, 3, 8, 20]),
                    ignore_eos=rng.random() < 0.5,
                    priority=rng.choice([0, 1, 5, 9]),
                    num_logprobs=1 if rng.random() < 0.05 else 0,
                )
                if tenants != ("",):
                    index = len(valid_requests) % len(tenants)
                    request = dataclasses.replace(
                        request, tenant=tenants[index], tenant_weight=float(index + 1)
                    )
                if max_n > 1 and rng.random() < 0.33:
                    request = dataclasses.replace(request, n=rng.randrange(2, max_n + 1))
                valid_requests[request_id] = request
                try:
                    scheduler.add(request, now)
                except (QueueFullError, RequestTooLargeError):
                    del valid_requests[request_id]
                    continue
                del valid_requests[request_id]
                for sample_id in sample_request_ids(request_id, request.n):
                    valid_requests[sample_id] = request
                    live.add(sample_id)
                    queued.append(scheduler.core._requests[sample_id])
                counts["samples"] += request.n - 1
        if live and rng.random() < p_cancel:
            output = scheduler.cancel(rng.choice(sorted(live)), now)
            take([output] if output is not None else [])
            check_invariants(scheduler)
        if in_flight and rng.random() < p_loss:
            take(scheduler.processor.process(scheduler.core.detach_worker("lost")))
            in_flight.clear()
            worker = FakeWorker(geometry, overlapped=overlap)
            take(scheduler.attach_worker(geometry))
            counts["losses"] += 1
            check_invariants(scheduler)
        if not in_flight or (overlap and scheduler.can_plan_ahead):
            plan = scheduler.schedule(now, ahead=bool(in_flight))
            if plan is not None:
                if plans is not None:
                    plans.append(copy.deepcopy(plan))
                # The worker runs each plan as it is sent: N+1 before N's result is applied.
                doomed = bool(in_flight) and in_flight[-1][1]
                if doomed:
                    result = worker.fail(plan, "after a failed one")
                elif rng.random() < p_fail:
                    result, doomed = worker.fail(plan), True
                    counts["fails"] += 1
                else:
                    refuse = {rng.choice(plan.seq_ids)} if rng.random() < p_refuse else set()
                    result = worker.step(plan, refuse=refuse)
                    counts["refusals"] += bool(result.errors)
                in_flight.append((result, doomed))
                if len(in_flight) == 1 and overlap:
                    continue
        if in_flight:
            take(scheduler.apply(in_flight.popleft()[0], now + 0.5))
            check_invariants(scheduler)
            check_blocks(scheduler)
            check_keys(scheduler, worker, queued)
        elif step >= num_arrival_steps and not scheduler.has_work():
            break
    else:
        raise AssertionError(f"seed {seed}: work left after {max_steps} steps, knobs {knobs}")
    for request_id, request in valid_requests.items():
        stream = streams[request_id]
        assert stream.finish_reason is not None, (seed, request_id, "never finished")
        assert stream.num_events_after_finish == 0, (seed, request_id)
        token_ids, reason, _ = expected_generation(request, geometry)
        if stream.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            assert (stream.token_ids, stream.finish_reason) == (token_ids, reason), (
                seed,
                request_id,
                knobs,
            )
        else:
            assert stream.token_ids == token_ids[: len(stream.token_ids)], (seed, request_id)
    return counts


def check_blocks(scheduler: TextScheduler) -> None:
    """No held block is free; evictable blocks are ownerless and keyed; keys map both ways."""
    blocks = scheduler.core._planner.blocks
    if blocks is None:
        return
    allocator = blocks.allocator
    for request in scheduler.core._planner.running.values():
        for block_id in request.block_ids:
            assert not allocator.is_free(block_id), f"{request.request_id} holds free {block_id}"
    for block_id in blocks._evictable:
        assert allocator.ref_count(block_id) == 0 and blocks.block_hash(block_id) is not None
    for block_hash, block_id in blocks._block_of_hash.items():
        assert blocks.block_hash(block_id) == block_hash and not allocator.is_free(block_id)


def check_keys(scheduler: TextScheduler, worker: FakeWorker, queued: list[Request]) -> None:
    """Every prefix-cache key not owned by a step in flight names a block whose K/V on
    the worker holds exactly the keyed tokens."""
    planner = scheduler.core._planner
    blocks = planner.blocks
    if blocks is None or not blocks._block_of_hash:
        return
    in_flight = scheduler.core._in_flight
    pending = {block_id for flight in in_flight for _, block_id in flight.keyed}
    for flight in in_flight:
        for request, seq_id, position in flight.key_later:
            index = position // BLOCK_SIZE
            if request.seq_id == seq_id and index < len(request.block_ids):
                pending.add(request.block_ids[index])
    tokens_of_hash: dict[int, list[int]] = {}
    for request in queued:
        for index, block_hash in enumerate(request.block_hashes):
            tokens_of_hash.setdefault(block_hash, request.token_ids[: (index + 1) * BLOCK_SIZE])
    for block_hash, block_id in blocks._block_of_hash.items():
        token_ids = tokens_of_hash.get(block_hash)
        if block_id in pending or token_ids is None:
            continue
        prefix_hash = 0  # as the FakeWorker models a K/V slot: a hash of its whole prefix
        for token_id in token_ids:
            prefix_hash = hash((prefix_hash, token_id))
        assert worker._slots.get((block_id, BLOCK_SIZE - 1)) == prefix_hash, (
            f"keyed block {block_id} holds other K/V than its key's tokens"
        )
