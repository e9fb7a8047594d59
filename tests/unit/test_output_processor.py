"""The output processor's own contract beyond the step loop's tests: a broken invariant
(a token of a request without a text state) ends that request, not the step loop."""

from __future__ import annotations

from pagoda.scheduler_svc.core import FinishReason
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import (
    drive,
    expected_generation,
    make_geometry,
    make_request,
    make_scheduler,
)


def test_a_token_without_a_text_state_ends_that_request_with_error_and_the_rest_go_on():
    geometry = make_geometry()
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    lost, kept = (
        make_request("lost", 6, max_new_tokens=9),
        make_request("kept", 7, max_new_tokens=9),
    )
    scheduler.add(lost, 0.0)
    scheduler.add(kept, 0.0)
    del scheduler.processor._texts["lost"]  # as if the invariant broke
    outputs = scheduler.apply(worker.step(scheduler.schedule(0.0)), 0.5)
    (ended,) = [output for output in outputs if output.request_id == "lost"]
    assert ended.finish_reason is FinishReason.ERROR and "text state" in ended.error_message
    assert not scheduler.holds("lost") and scheduler.holds("kept")
    streams = drive(scheduler, worker)
    token_ids, reason, _ = expected_generation(kept, geometry)
    assert streams["kept"].token_ids == token_ids[1:] and streams["kept"].finish_reason is reason
