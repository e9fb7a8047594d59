"""Output slots coalesce deltas so the step loop never waits for a reader."""

from __future__ import annotations

import asyncio

from pagoda.scheduler_svc.core import FinishReason, RequestOutput, StepOutputs, TokenLogprob
from pagoda.scheduler_svc.output_streams import OutputStreams


def out(text, ids, finish=None, logprobs=None):
    return RequestOutput("r1", text, ids, logprobs, finish)


def test_unread_outputs_merge_into_one_in_order():
    async def scenario():
        streams = OutputStreams()
        slot = streams.open("r1")
        streams.publish([out("Hel", [1], logprobs=[TokenLogprob(1, -0.1, [], [])])])
        streams.publish([out("lo", [2], logprobs=[TokenLogprob(2, -0.2, [], [])])])
        streams.publish(
            [out("!", [3], FinishReason.STOP, logprobs=[TokenLogprob(3, -0.3, [], [])])]
        )
        merged = await slot.next()
        assert (merged.text, merged.token_ids, merged.finish_reason) == (
            "Hello!",
            [1, 2, 3],
            FinishReason.STOP,
        )
        assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3]
        # Nothing after the finish is accepted.
        slot.publish(out("late", [9]))
        assert not slot.has_pending

    asyncio.run(scenario())


def test_a_reader_gets_each_delta_exactly_once():
    async def scenario():
        streams = OutputStreams()
        slot = streams.open("r1")
        received = []

        async def reader():
            while True:
                output = await slot.next()
                received.extend(output.token_ids)
                if output.finish_reason:
                    return

        task = asyncio.create_task(reader())
        for i in range(100):
            streams.publish([out(str(i), [i], FinishReason.LENGTH if i == 99 else None)])
            if i % 7 == 0:
                await asyncio.sleep(0)
        await task
        assert received == list(range(100))

    asyncio.run(scenario())


def test_outputs_for_closed_requests_are_dropped():
    streams = OutputStreams()
    streams.open("r1")
    streams.close("r1")
    streams.publish([out("x", [1])])  # no error, nothing kept
    assert "r1" not in streams and len(streams) == 0


def test_a_step_of_token_columns_and_a_finish_reaches_each_slot_in_order():
    async def scenario():
        streams = OutputStreams()
        first, second = streams.open("r1"), streams.open("r2")
        streams.publish_step(StepOutputs(["r1", "r2", "gone"], ["He", "a", "x"], [1, 5, 9]))
        streams.publish_step(
            StepOutputs(["r2"], ["b"], [6], [out("llo", [2], FinishReason.LENGTH)])
        )
        merged = await first.next()
        assert (merged.text, merged.token_ids, merged.finish_reason) == (
            "Hello",
            [1, 2],
            FinishReason.LENGTH,
        )
        assert merged.usage is None and merged.logprobs is None
        pending = await second.next()
        assert (pending.text, pending.token_ids, pending.finish_reason) == ("ab", [5, 6], None)
        assert first.finished and not second.finished

    asyncio.run(scenario())


def test_a_slot_that_is_not_read_ends_its_request_and_drops_its_output():
    """Security review H1: unread output is bounded per slot, then the request is ended."""
    overflowed: list[str] = []

    async def scenario():
        streams = OutputStreams(max_unread_tokens=10, on_overflow=overflowed.append)
        slot = streams.open("r1")
        for token_id in range(10):
            slot.publish_token("x", token_id)
        assert overflowed == []
        slot.publish_token("y", 10)  # the 11th unread token
        assert overflowed == ["r1"] and slot.error_code == "RESOURCE_EXHAUSTED"
        slot.publish_token("z", 11)  # dropped; asked to end only once
        assert overflowed == ["r1"]
        streams.publish([out("", [12], FinishReason.CANCELLED)])  # the request's end
        final = await slot.next()
        assert final.finish_reason is FinishReason.ERROR and final.token_ids == []
        assert "unread" in final.error_message

    asyncio.run(scenario())


def test_a_reader_that_keeps_up_never_overflows_and_logprobs_count():
    async def scenario():
        streams = OutputStreams(max_unread_tokens=10, on_overflow=lambda rid: None)
        slot = streams.open("r1")
        for token_id in range(30):
            slot.publish_token("x", token_id)
            assert (await slot.next()).token_ids == [token_id]
        # Each top-logprob alternative counts as one more unread token.
        top = TokenLogprob(1, -0.1, [2, 3, 4, 5], [-1.0, -2.0, -3.0, -4.0])
        streams.publish([out("a", [1], logprobs=[top]), out("b", [1], logprobs=[top])])
        assert not slot.overflowed  # 10 units
        streams.publish([out("c", [1], FinishReason.LENGTH, logprobs=[top])])
        final = await slot.next()  # a finished, overflowing slot ends with the error
        assert final.finish_reason is FinishReason.ERROR and final.text == ""

    asyncio.run(scenario())
