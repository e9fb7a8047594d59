"""Output slots coalesce deltas so the step loop never waits for a reader."""

from __future__ import annotations

import asyncio

from pagoda.scheduler_svc.core import FinishReason, RequestOutput, StepOutputs, TokenLogprob
from pagoda.scheduler_svc.output_streams import MIN_UNREAD_TOKENS_TO_END, OutputStreams


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


def test_the_turnstile_wakes_readers_a_few_per_turn_in_the_order_their_output_came():
    """Waking every reader of a step at once makes one long event-loop turn that the
    worker's next result waits behind: at most `readers_per_turn` readers run per turn."""

    async def scenario():
        streams = OutputStreams(readers_per_turn=2)
        slots = [streams.open(f"r{i}") for i in range(6)]
        turns: list[list[str]] = []
        turn = 0

        async def reader(slot):
            output = await slot.next()
            while len(turns) <= turn:
                turns.append([])
            turns[turn].append(output.request_id)
            streams.close(slot.request_id)  # its stream ended: its place goes to the next

        readers = [asyncio.create_task(reader(slot)) for slot in slots]
        await asyncio.sleep(0)  # every reader waits
        # Published in the order r5, r4, ..., r0.
        streams.publish([RequestOutput(f"r{i}", "x", [i], None) for i in reversed(range(6))])
        while not all(reader.done() for reader in readers):
            await asyncio.sleep(0)
            turn += 1
        assert [len(names) for names in turns if names] == [2, 2, 2]
        assert [name for names in turns for name in names] == [f"r{i}" for i in reversed(range(6))]

    asyncio.run(scenario())


def test_a_reader_waiting_in_line_takes_everything_published_meanwhile_as_one_output():
    async def scenario():
        streams = OutputStreams(readers_per_turn=1)
        first, second = streams.open("r1"), streams.open("r2")
        streams.publish([RequestOutput("r1", "a", [1], None), RequestOutput("r2", "b", [2], None)])
        streams.publish([RequestOutput("r2", "c", [3], None)])  # r2 is still in line
        assert (await first.next()).token_ids == [1]
        streams.close("r1")
        merged = await second.next()
        assert (merged.text, merged.token_ids) == ("bc", [2, 3])

    asyncio.run(scenario())


def test_a_reader_that_leaves_gives_its_place_in_line_to_the_next():
    """A client gone while its reader was woken, or while it waited in line, must not
    keep the others waiting: the turnstile would stall every stream."""

    async def scenario():
        streams = OutputStreams(readers_per_turn=1)
        woken, queued, last = (streams.open(name) for name in ("r1", "r2", "r3"))
        streams.publish(
            [RequestOutput(name, "x", [i], None) for i, name in enumerate(("r1", "r2", "r3"))]
        )
        streams.close("r1")  # woken, never took
        streams.close("r2")  # waited in line
        output = await asyncio.wait_for(last.next(), timeout=5)
        assert output.token_ids == [2]
        assert woken.has_pending and queued.has_pending  # dropped with their slots

    asyncio.run(scenario())


def test_a_reader_holds_its_place_while_writing_but_not_past_the_next_step():
    """Writes go one at a time (messages grow under load), but a client that stopped
    reading leaves its reader blocked in a write for good: had it kept its place, every
    other stream would wait for that write's timeout. The next step takes the place back,
    and a reader away writing takes none."""

    async def scenario():
        streams = OutputStreams(readers_per_turn=1)
        stuck, other = streams.open("r1"), streams.open("r2")
        taking = asyncio.create_task(stuck.next())
        waiting = asyncio.create_task(other.next())
        await asyncio.sleep(0)  # both readers wait
        streams.publish([RequestOutput("r1", "a", [1], None)])
        assert (await taking).token_ids == [1]  # then blocks in its write, say
        streams.publish([RequestOutput("r2", "b", [2], None)])
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not waiting.done()  # the place is r1's while it writes
        streams.publish_step(StepOutputs(["r1", "r2"], ["c", "d"], [3, 4]))
        assert (await asyncio.wait_for(waiting, timeout=5)).token_ids == [2, 4]
        back = asyncio.create_task(other.next())  # r2 back from its write: the place is free
        # r1 back from its write too: its output came meanwhile, it takes in turn.
        assert (await asyncio.wait_for(stuck.next(), timeout=5)).token_ids == [3]
        back.cancel()

    asyncio.run(scenario())


def test_output_a_waiting_reader_has_not_taken_yet_is_not_counted_as_unread():
    """Only what comes while the reader is away (writing to its client) counts toward the
    unread cap: output waiting for the reader's turn is the server's lag, not the client's."""

    async def scenario():
        streams = OutputStreams(max_unread_tokens=3, readers_per_turn=1)
        first, second = streams.open("r1"), streams.open("r2")

        async def take_once(slot):
            output = await slot.next()
            if slot is first:
                streams.close("r1")  # r1's stream ends; r2 is left away, writing
            return output

        readers = [asyncio.create_task(take_once(slot)) for slot in (first, second)]
        await asyncio.sleep(0)
        for token_id in range(5):  # before either reader's turn
            streams.publish([RequestOutput(name, "x", [token_id], None) for name in ("r1", "r2")])
        outputs = await asyncio.gather(*readers)
        assert [output.token_ids for output in outputs] == [[0, 1, 2, 3, 4]] * 2
        assert not first.overflowed and not second.overflowed
        # Away from next(), the same five overflow the cap.
        for token_id in range(5):
            streams.publish([RequestOutput("r2", "x", [token_id], None)])
        assert second.overflowed

    asyncio.run(scenario())


def test_unread_output_is_bounded_over_all_slots_together():
    """Security review N4: per slot alone, 4,000 stalled streams held about 1 GB. Past the
    shared budget, a slot holding a large share is ended; one that keeps up is not."""
    overflowed: list[str] = []

    async def scenario():
        streams = OutputStreams(
            max_unread_tokens=2048, max_total_unread_tokens=500, on_overflow=overflowed.append
        )
        stalled = [streams.open(f"s{index}") for index in range(10)]
        reader = streams.open("reader")
        for token_id in range(200):
            for slot in stalled:
                slot.publish_token("x", token_id)
            reader.publish_token("y", token_id)
            assert (await reader.next()).token_ids == [token_id]
            # Within the budget, plus less than the share that gets a slot ended.
            assert streams.budget.num_tokens <= 500 + 10 * MIN_UNREAD_TOKENS_TO_END
        assert "reader" not in overflowed and len(overflowed) >= 5
        ended = stalled[int(overflowed[0][1:])]
        streams.publish([RequestOutput(ended.request_id, "", [], None, FinishReason.CANCELLED)])
        final = await ended.next()
        assert final.finish_reason is FinishReason.ERROR
        assert "the server holds too much unread output" in final.error_message
        for slot in stalled:
            streams.close(slot.request_id)
        streams.close("reader")
        assert streams.budget.num_tokens == 0  # every share given back

    asyncio.run(scenario())


def test_tokens_waiting_for_the_readers_turn_count_toward_the_shared_budget():
    """Under CPU load the turnstile's line crawls and waiting readers pile up output (in a
    live run, hundreds of tokens each, 1.1 GB in all). Not their clients' fault, so no
    per-slot cap; but past the shared budget the readers most behind are ended."""
    overflowed: list[str] = []

    async def scenario():
        streams = OutputStreams(
            max_unread_tokens=100,
            max_total_unread_tokens=300,
            on_overflow=overflowed.append,
            readers_per_turn=1,
        )
        writer = streams.open("writer")
        waiting = [streams.open(f"w{index}") for index in range(3)]
        writer.publish_token("x", 0)
        await writer.next()  # it holds the one place while it writes (never comes back)
        readers = [asyncio.create_task(slot.next()) for slot in waiting]
        await asyncio.sleep(0)  # all three wait in next(), in line behind the writer
        for token_id in range(150):
            streams.publish(
                [RequestOutput(slot.request_id, "x", [token_id], None) for slot in waiting]
            )
        assert overflowed and "writer" not in overflowed
        assert streams.budget.num_tokens <= 300 + 3 * 100
        for task in readers:
            task.cancel()

    asyncio.run(scenario())


def test_a_reader_woken_for_output_an_overflow_dropped_waits_for_the_requests_end():
    overflowed: list[str] = []

    async def scenario():
        streams = OutputStreams(max_unread_tokens=5, on_overflow=overflowed.append)
        slot = streams.open("r1")
        slot.publish_token("x", 0)  # the reader is away: pending, and its wake is set
        for token_id in range(1, 6):
            slot.publish_token("x", token_id)
        assert overflowed == ["r1"] and not slot.has_pending
        reader = asyncio.create_task(slot.next())
        await asyncio.sleep(0)
        assert not reader.done()  # it waits: nothing to take
        streams.publish([out("", [9], FinishReason.CANCELLED)])
        final = await reader
        assert final.finish_reason is FinishReason.ERROR

    asyncio.run(scenario())
