"""Property-based: random workloads under random knobs, run against the checking fake
worker. Whatever the schedule, every request streams exactly what the dummy model
generates for it alone, and block ownership stays exact."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagoda.common.dummy_tokens import dummy_next_token
from pagoda.scheduler_svc.core import FinishReason, ValidRequest, WorkerGeometry
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import (
    LETTERS,
    Stream,
    TextScheduler,
    caps_violated,
    check_invariants,
    expected_generation,
    make_geometry,
    make_request,
    make_scheduler,
    plan_within_budget,
    repeating_next_token,
)

MAX_STEPS = 3000


@dataclass
class Workload:
    arrivals: list[tuple[int, ValidRequest]]  # (step, request), by step
    knobs: dict
    geometry: WorkerGeometry
    cancels: dict[int, list[str]] = field(default_factory=dict)  # step -> request ids
    # step -> "lost" (fail_step), "error" (the worker's step_error), "restart" (new worker)
    # or "refuse" (the worker refuses one sequence: the newest of the plan)
    failures: dict[int, str] = field(default_factory=dict)
    # Filled by run(): request id -> "error" steps it was alone in.
    failed_alone: Counter = field(default_factory=Counter)
    refused: set[str] = field(default_factory=set)  # filled by run()
    # The worker refuses every writer of blocks another sequence of its step reads.
    refuse_shared_writers: bool = False
    # The model (FakeWorker's next_token): the dummy's, or one that repeats itself.
    next_token: Callable = dummy_next_token


@st.composite
def workloads(draw, with_cancels: bool = False, with_failures: bool = False) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    vocab_size = draw(st.integers(20, 60))
    token = st.integers(0, vocab_size - 1)
    eos_token_ids = draw(st.sets(token, max_size=2))
    shared_prefixes = draw(st.lists(st.lists(token, max_size=14), min_size=1, max_size=3))
    arrivals = []
    for index in range(draw(st.integers(1, 10))):
        prompt = draw(st.sampled_from(shared_prefixes)) + draw(st.lists(token, max_size=10))
        max_new_tokens = draw(st.integers(1, 12))
        request = make_request(
            f"r{index}",
            prompt or [1],
            max_new_tokens=max_new_tokens,
            min_new_tokens=draw(st.integers(0, max_new_tokens)),
            stop_token_ids=draw(st.sets(token, max_size=2)),
            stop_strings=tuple(draw(st.lists(st.text("abc", min_size=1, max_size=3), max_size=2))),
            ignore_eos=draw(st.booleans()),
            priority=draw(st.integers(0, 3)),
            num_logprobs=draw(st.sampled_from([0, 0, 2])),
        )
        time_limit_s = draw(st.none() | st.floats(0, 50, allow_nan=False))
        request = dataclasses.replace(request, time_limit_s=time_limit_s)
        arrivals.append((draw(st.integers(0, 15)), request))
    arrivals.sort(key=lambda arrival: arrival[0])
    cap = st.none() | st.integers(1, 48)
    knobs = dict(
        max_num_batched_tokens=draw(st.integers(1, 48)),
        prefill_max_tokens=draw(cap),
        prefill_max_batch_size=draw(st.none() | st.integers(1, 4)),
        max_active_requests=draw(st.integers(1, 8)),
        max_decode_batch_size=draw(st.none() | st.integers(1, 6)),
        admission_policy=draw(st.sampled_from(["fifo", "pack", "prefix", "deadline", "priority"])),
        admission_lookahead=draw(st.integers(1, 6)),
        force_fifo_every=draw(st.none() | st.integers(0, 3)),
        chunked_prefill=draw(st.booleans()),
        decode_first=draw(st.booleans()),
        prefix_caching=draw(st.booleans()),
        speculative_tokens=draw(st.sampled_from([0, 0, 1, 3, 6])),
        speculative_ngram_min=(ngram_min := draw(st.integers(1, 2))),
        speculative_ngram_max=ngram_min + draw(st.integers(0, 2)),
        speculative_max_batch=draw(st.integers(1, 4)),
    )
    longest = max(len(r.prompt_token_ids) + r.stopping.max_new_tokens for _, r in arrivals)
    min_blocks = -(-(longest - 1) // block_size)
    geometry = make_geometry(
        num_kv_blocks=draw(st.integers(min_blocks, 2 * min_blocks + 2)),
        block_size=block_size,
        max_context_tokens=longest + draw(st.integers(0, 8)),
        eos_token_ids=eos_token_ids,
        vocab_size=vocab_size,
    )
    workload = Workload(arrivals, knobs, geometry)
    workload.next_token = draw(st.sampled_from([dummy_next_token, repeating_next_token]))
    if with_cancels:
        for _, request in arrivals:
            if draw(st.booleans()):
                workload.cancels.setdefault(draw(st.integers(0, 40)), []).append(request.request_id)
    if with_failures:
        for step in draw(st.sets(st.integers(0, 40), max_size=3)):
            workload.failures[step] = draw(st.sampled_from(["lost", "error", "restart", "refuse"]))
    return workload


def run(
    workload: Workload, geometry: WorkerGeometry | None = None
) -> tuple[dict[str, Stream], TextScheduler]:
    """Drive the workload to the end, checking invariants after every call."""
    geometry = geometry or workload.geometry
    scheduler = make_scheduler(geometry, **workload.knobs)
    worker = FakeWorker(geometry, next_token=workload.next_token)
    streams: dict[str, Stream] = defaultdict(Stream)
    failed_alone = workload.failed_alone
    failed_alone.clear()
    workload.refused.clear()
    arrivals = list(workload.arrivals)
    state = scheduler.core._planner
    requests = scheduler.core._requests
    for step in range(MAX_STEPS):
        now = float(step)
        while arrivals and arrivals[0][0] <= step:
            scheduler.add(arrivals.pop(0)[1], now)
        for request_id in workload.cancels.get(step, []):
            request = requests.get(request_id)
            seq_id = request.seq_id if request is not None else None
            output = scheduler.cancel(request_id, now)
            if output is not None:
                streams[request_id].take(output)
            check_invariants(scheduler)  # its blocks are free already
            assert request_id not in requests
            if seq_id is not None:
                assert seq_id in state.forget_seq_ids  # the next plan forgets it
        num_preemptions = scheduler.stats.num_preemptions
        plan = scheduler.schedule(now)
        if plan is None:
            assert not scheduler.has_work()
            if not arrivals:
                return streams, scheduler
            continue
        assert plan_within_budget(plan, scheduler.config)
        assert caps_violated(plan, scheduler) is None, caps_violated(plan, scheduler)
        # A step that admits never preempts (an admission waits rather than evict an
        # older request); isolation's make_room preempts on purpose before its plan.
        if plan.new_sequences and not scheduler._isolation.active:
            assert scheduler.stats.num_preemptions == num_preemptions, "admitted and preempted"
        failure = workload.failures.get(step)
        shared_writer = shared_block_writer(scheduler, plan)
        if workload.refuse_shared_writers and shared_writer is not None:
            failure = "refuse"
            event("a writer of shared blocks refused")
        if failure == "refuse":
            seq_id = shared_writer if shared_writer is not None else plan.seq_ids[0]
            workload.refused.add(state.running[seq_id].request_id)
            for output in scheduler.apply(worker.step(plan, refuse={seq_id}), now + 0.5):
                streams[output.request_id].take(output)
            failure = "done"
        elif failure is not None:
            # A lost worker counts as a failed step: either may convict a request alone.
            ids = {state.running[s].request_id for s in plan.seq_ids if s in state.running}
            if len(ids) == 1:
                failed_alone[ids.pop()] += 1
        if failure == "lost" or failure == "restart":
            for output in scheduler.fail_step(plan, "worker lost", now):
                streams[output.request_id].take(output)
            if failure == "restart":
                scheduler.detach_worker()
                assert scheduler.attach_worker(geometry) == []
                worker = FakeWorker(geometry, next_token=workload.next_token)
        elif failure != "done":
            result = worker.fail(plan) if failure == "error" else worker.step(plan)
            for output in scheduler.apply(result, now + 0.5):
                streams[output.request_id].take(output)
        check_invariants(scheduler)
        # No sequence leaks on the worker: it holds the running ones and those to forget.
        assert (
            set(state.running)
            <= worker.live_seq_ids
            <= set(state.running) | set(state.forget_seq_ids)
        )
    raise AssertionError(f"not finished after {MAX_STEPS} steps")


def shared_block_writer(scheduler: TextScheduler, plan) -> int | None:
    """A sequence of `plan` that writes blocks another sequence of the step reads (a
    same-step prefix hit), if any."""
    running = scheduler.core._planner.running
    (flight,) = [f for f in scheduler.core._in_flight if f.plan is plan]
    writer_of = {block_id: seq_id for seq_id, block_id in flight.keyed}
    for seq_id in plan.seq_ids:
        for block_id in running[seq_id].block_ids:
            writer = writer_of.get(block_id, seq_id)
            if writer != seq_id:
                return writer
    return None


def check_streams(workload: Workload, streams: dict[str, Stream]) -> None:
    cancelled = {rid for ids in workload.cancels.values() for rid in ids}
    for _, request in workload.arrivals:
        stream = streams[request.request_id]
        assert stream.finish_reason is not None, f"{request.request_id} never finished"
        assert stream.num_events_after_finish == 0
        token_ids, reason, text = expected_generation(
            request, workload.geometry, workload.next_token
        )
        if stream.finish_reason is FinishReason.ERROR:
            # Only a request that failed twice alone is taken for a poison request, or
            # one the worker refused.
            assert (
                workload.failed_alone[request.request_id] >= 2
                or request.request_id in workload.refused
            )
            assert stream.token_ids == token_ids[: len(stream.token_ids)]
        elif stream.finish_reason is FinishReason.CANCELLED:
            assert request.request_id in cancelled
            assert stream.token_ids == token_ids[: len(stream.token_ids)]
            # A cancel releases the text held back for a possible stop string
            # (test_stop_rules.test_a_cancel_releases_held_text_then_pending_bytes): the
            # text of every token streamed, which the whole run may cut at a stop string.
            assert stream.text == "".join(LETTERS[t % 26] for t in stream.token_ids)
        else:
            assert (stream.token_ids, stream.finish_reason, stream.text) == (
                token_ids,
                reason,
                text,
            )
        assert stream.usage.completion_tokens == len(stream.token_ids)


# A few seconds per property here; PAGODA_HYPOTHESIS_EXAMPLES=5000 for a deep search.
MAX_EXAMPLES = int(os.environ.get("PAGODA_HYPOTHESIS_EXAMPLES", "200"))
COMMON = settings(
    max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@COMMON
@given(workloads())
def test_every_request_streams_its_reference_output_exactly_once(workload):
    streams, scheduler = run(workload)
    check_streams(workload, streams)
    stats = scheduler.stats
    assert stats.num_running == stats.num_waiting == stats.num_kv_blocks_used == 0
    if stats.num_draft_tokens:
        event(f"drafts kept: {stats.num_accepted_draft_tokens > 0}")


@COMMON
@given(workloads())
def test_preempted_requests_resume_with_the_output_of_an_unpressured_run(workload):
    block_size = workload.geometry.block_size
    # Room for every request at its longest at once: nothing is ever preempted.
    everything = sum(
        -(-(len(r.prompt_token_ids) + r.stopping.max_new_tokens) // block_size)
        for _, r in workload.arrivals
    )
    roomy = make_geometry(
        num_kv_blocks=everything,
        block_size=workload.geometry.block_size,
        max_context_tokens=workload.geometry.max_context_tokens,
        eos_token_ids=workload.geometry.eos_token_ids,
        vocab_size=workload.geometry.vocab_size,
    )
    streams, scheduler = run(workload)
    roomy_streams, roomy_scheduler = run(workload, roomy)
    assert roomy_scheduler.stats.num_preemptions == 0
    event(f"preempted: {scheduler.stats.num_preemptions > 0}")
    for request_id, stream in streams.items():
        roomy_stream = roomy_streams[request_id]
        assert (stream.token_ids, stream.text, stream.finish_reason) == (
            roomy_stream.token_ids,
            roomy_stream.text,
            roomy_stream.finish_reason,
        )


@COMMON
@given(workloads(with_cancels=True, with_failures=True))
def test_cancels_and_worker_failures_lose_and_repeat_nothing(workload):
    streams, _ = run(workload)
    check_streams(workload, streams)


@COMMON
@given(workloads())
def test_a_refused_writer_leaves_no_sequence_on_blocks_nobody_wrote(workload):
    """Every writer of blocks that a same-step prefix hit shares is refused by the worker:
    the readers recompute (the fake worker fails a plan that feeds one again, and gives
    it a wrong token meanwhile), and only the refused requests end with ERROR."""
    workload.refuse_shared_writers = True
    streams, _ = run(workload)
    check_streams(workload, streams)


def test_a_step_that_only_preempted_is_planned_again_at_once():
    """Found by the property above at 3000 examples: while a lost step's suspects are
    isolated, an ordinary step's only decoder needed a block that a suspect held; it
    preempted itself, and the plan fed nothing though its blocks were free now. The
    scheduler plans again instead of returning None (an idle turn of the step loop)."""
    prompt = [0, 0, 0, 0]
    workload = Workload(
        arrivals=[
            (3, make_request("r2", prompt, max_new_tokens=4)),
            (8, make_request("r0", prompt, max_new_tokens=1)),
            (8, make_request("r1", [0] * 6, max_new_tokens=6)),
            (8, make_request("r4", prompt, max_new_tokens=1)),
            (14, make_request("r3", [1], max_new_tokens=1)),
        ],
        knobs=dict(max_num_batched_tokens=3, max_active_requests=3, prefix_caching=False),
        geometry=make_geometry(
            num_kv_blocks=16, block_size=1, max_context_tokens=12, vocab_size=20
        ),
        failures={7: "lost", 16: "lost"},
    )
    streams, _ = run(workload)  # asserts that a plan is None only without work
    check_streams(workload, streams)


def test_a_suspect_halfway_through_its_prompt_keeps_its_turn():
    """Found by the cancels-and-failures property: a suspect recomputed in chunks (a lost
    step fed it alone) held its blocks between group steps, while the requests that its
    blocks made preempt themselves waited at the queue's head and went first, every step:
    the longest could never finish, and nobody ever ended. A group halfway through a
    prompt now keeps its turn every other step."""

    def request(request_id, length, max_new_tokens, time_limit_s=None):
        made = make_request(request_id, [0] * length, max_new_tokens=max_new_tokens)
        return dataclasses.replace(made, time_limit_s=time_limit_s)

    workload = Workload(
        arrivals=[
            (0, request("r9", 5, 10)),
            (7, request("r6", 7, 8)),
            (8, request("r0", 2, 2, 0.0)),
            (8, request("r1", 12, 6)),
            (8, request("r4", 8, 4, 0.0)),
            (12, request("r8", 12, 8, 46.75)),
            (15, request("r3", 7, 8, 0.0)),
        ],
        knobs=dict(
            prefill_max_tokens=10,
            admission_policy="deadline",
            decode_first=False,
            prefix_caching=False,
        ),
        geometry=make_geometry(
            num_kv_blocks=27, block_size=1, max_context_tokens=20, vocab_size=60
        ),
        failures={6: "lost", 26: "lost"},
    )
    streams, _ = run(workload)  # "not finished after 3000 steps" before
    check_streams(workload, streams)
