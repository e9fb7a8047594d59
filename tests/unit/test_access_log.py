"""The access log's record of one call: the trace id of a W3C traceparent, the samples'
tokens added up, and one line with its fields."""

from __future__ import annotations

import logging

import grpc

from pagoda.scheduler_svc.access_log import CallRecord, trace_id_of
from pagoda.scheduler_svc.core import FinishReason, RequestOutput, Timings, Usage

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def finishing(completion_tokens: int, reason: FinishReason, cached: int = 8) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        text="",
        token_ids=[],
        logprobs=None,
        finish_reason=reason,
        usage=Usage(12, completion_tokens, cached, 0),
        timings=Timings(queued_ms=1.0, first_token_ms=20.0, total_ms=90.0),
    )


def test_the_trace_id_comes_from_a_well_formed_traceparent_only():
    assert trace_id_of([("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01")]) == TRACE_ID
    assert trace_id_of([("traceparent", "00-xyz-00f067aa0ba902b7-01")]) == ""
    assert trace_id_of([("authorization", "Bearer k")]) == ""
    assert trace_id_of(None) == ""


def test_one_line_per_call_with_the_samples_added_up(caplog):
    record = CallRecord("Generate", "ipv4:127.0.0.1:5000", TRACE_ID)
    record.request_id, record.tenant = "r", "alice"
    record.finished(finishing(3, FinishReason.LENGTH), 0)
    record.finished(finishing(2, FinishReason.STOP), 1)
    with caplog.at_level(logging.INFO, logger="pagoda.access"):
        record.write(None)
    (line,) = caplog.records
    assert line.name == "pagoda.access"
    assert (line.status, line.finish_reasons) == ("OK", "LENGTH,STOP")
    assert (line.prompt_tokens, line.cached_prompt_tokens, line.completion_tokens) == (12, 8, 5)
    assert (line.trace_id, line.tenant, line.first_token_ms) == (TRACE_ID, "alice", 20.0)
    assert "Generate r OK LENGTH,STOP tokens 12+5 (8 cached)" in line.getMessage()


def test_a_refused_call_logs_its_status_and_no_tokens(caplog):
    record = CallRecord("Chat", "ipv4:127.0.0.1:5000", "")
    with caplog.at_level(logging.INFO, logger="pagoda.access"):
        record.write(grpc.StatusCode.INVALID_ARGUMENT)
    (line,) = caplog.records
    assert (line.status, line.completion_tokens, line.first_token_ms) == (
        "INVALID_ARGUMENT",
        0,
        None,
    )


def test_samples_count_as_the_calls_total_usage_does(caplog):
    """Sample 1 hits the blocks sample 0 computed: the prompt and its cached part are
    sample 0's, as in the call's total_usage, whichever sample ends first."""
    record = CallRecord("Generate", "ipv4:127.0.0.1:5000", "")
    record.finished(finishing(4, FinishReason.LENGTH, cached=12), 1)
    record.finished(finishing(4, FinishReason.LENGTH, cached=0), 0)
    with caplog.at_level(logging.INFO, logger="pagoda.access"):
        record.write(None)
    (line,) = caplog.records
    assert (line.prompt_tokens, line.cached_prompt_tokens, line.completion_tokens) == (12, 0, 8)
