"""A lost worker's requests move to another worker's scheduler (several workers, lanes):
they stream on from the tokens they had, nothing repeated or lost, and a suspect of a
lost step stays a suspect with its solo failures."""

from __future__ import annotations

from collections import defaultdict

import pytest

from pagoda.scheduler_svc.core import Scheduler, SchedulerConfig
from pagoda.scheduler_svc.output_processor import OutputProcessor
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import (
    LetterDetokenizer,
    Stream,
    TextScheduler,
    check_invariants,
    drive,
    expected_generation,
    make_geometry,
    make_request,
    make_scheduler,
)


def shared_lanes(geometry) -> tuple[TextScheduler, TextScheduler]:
    """Two cores behind one output processor, as the front's lanes share their text states."""
    cores = [Scheduler(SchedulerConfig()), Scheduler(SchedulerConfig())]
    processor = OutputProcessor(LetterDetokenizer)  # type: ignore[arg-type]
    lanes = TextScheduler(cores[0], processor), TextScheduler(cores[1], processor)
    for lane in lanes:
        lane.attach_worker(geometry)
    return lanes


def test_requests_of_a_lost_worker_stream_on_elsewhere_without_repeats():
    geometry = make_geometry(block_size=4)
    lost, kept = shared_lanes(geometry)
    lost_worker, kept_worker = FakeWorker(geometry), FakeWorker(geometry)
    requests = [make_request(f"r{i}", 6 + i, max_new_tokens=12) for i in range(4)]
    for request in requests[:3]:
        lost.add(request, 0.0)
    kept.add(requests[3], 0.0)
    streams: dict[str, Stream] = defaultdict(Stream)
    for step in range(4):  # everything on the lost worker has streamed some tokens
        plan = lost.schedule(float(step))
        for output in lost.apply(lost_worker.step(plan), float(step)):
            streams[output.request_id].take(output)
    assert all(streams[r.request_id].token_ids for r in requests[:3])
    lost.schedule(5.0)  # a step in flight when the worker is lost
    lost.detach_worker()
    moved, suspects = lost.core.hand_over()
    # The step in flight was lost with the worker: its requests are suspects.
    assert [r.request_id for r in moved] == ["r0", "r1", "r2"]
    assert suspects == [("r0", 0), ("r1", 0), ("r2", 0)]
    assert not lost.has_work() and not any(lost.holds(r.request_id) for r in requests)
    assert kept.core.take_over(moved, suspects, 6.0) == []
    assert all(kept.holds(r.request_id) for r in requests)
    check_invariants(kept)
    drive(kept, kept_worker, streams)
    for request in requests:
        tokens, reason, text = expected_generation(request, geometry)
        stream = streams[request.request_id]
        assert (stream.token_ids, stream.finish_reason, stream.text) == (tokens, reason, text)
        assert stream.num_events_after_finish == 0


def test_hand_over_needs_the_worker_detached():
    scheduler = make_scheduler()
    with pytest.raises(RuntimeError):
        scheduler.core.hand_over()


def test_suspects_move_with_their_solo_failures():
    geometry = make_geometry(block_size=4)
    lost, kept = make_scheduler(geometry), make_scheduler(geometry)
    lost.add(make_request("a", 6), 0.0)
    lost.add(make_request("b", 7), 0.0)
    plan = lost.schedule(0.0)
    assert lost.fail_step(plan, "worker died", 0.0) == []  # both suspects now
    plan = lost.schedule(1.0)  # "a" alone
    assert plan.num_sampling == 1
    assert lost.fail_step(plan, "worker died", 1.0) == []  # one solo failure
    lost.detach_worker()
    moved, suspects = lost.core.hand_over()
    assert suspects == [("a", 1), ("b", 0)]
    kept.core.take_over(moved, suspects, 2.0)
    plan = kept.schedule(2.0)  # "a" runs alone on the other worker too
    assert plan.num_sampling == 1
    (output,) = kept.fail_step(plan, "worker died", 2.0)  # and is convicted there
    assert (output.request_id, output.finish_reason.name) == ("a", "ERROR")


def test_a_request_the_other_worker_can_never_hold_ends_with_an_error():
    small = make_geometry(block_size=4, max_context_tokens=16)
    lost = make_scheduler(make_geometry(block_size=4))
    kept = make_scheduler(small)
    lost.add(make_request("long", 20, max_new_tokens=4), 0.0)
    lost.detach_worker()
    moved, suspects = lost.core.hand_over()
    (output,) = kept.core.take_over(moved, suspects, 1.0)
    assert output.finish_reason.name == "ERROR" and not kept.has_work()


def test_a_request_outside_the_other_workers_vocabulary_ends_with_an_error():
    """sched s3 smell 10: take_over checks the vocabulary as attach_worker does; else the
    other worker refuses the request at every admission."""
    lost = make_scheduler(make_geometry(vocab_size=1000))
    kept = make_scheduler(make_geometry(vocab_size=500))
    lost.add(make_request("wide", [1, 2, 900], max_new_tokens=4), 0.0)
    lost.add(make_request("narrow", [1, 2, 3], max_new_tokens=4), 0.0)
    lost.detach_worker()
    moved, suspects = lost.core.hand_over()
    (output,) = kept.core.take_over(moved, suspects, 1.0)
    assert (output.request_id, output.finish_reason.name) == ("wide", "ERROR")
    assert "outside the vocabulary" in output.error_message
    assert kept.core.holds("narrow")
