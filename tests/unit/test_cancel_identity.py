"""Review L1's scenario on the real StepLoop: client A leaves "job-1" while its last step is in
flight, and B submits "job-1" as soon as the id is free. A's cancel must not end B's
request. It does not: release() cancels only an unfinished slot, and the loop drains its
cancels right after apply() with no await between, so A's cancel meets A's request or no
request, never a newer one of the same id."""

from __future__ import annotations

import asyncio

from pagoda.scheduler_svc.core import FinishReason
from tests.unit.conftest import make_request
from tests.unit.test_step_loop import (
    assert_exact,
    assert_idle,
    first_output,
    read_to_end,
    running,
    scenario,
)


def test_a_cancel_left_by_one_request_never_ends_the_next_one_of_the_same_id():
    async def body() -> None:
        async with running() as h:
            await h.attach("w1")
            for num_new_tokens in (2, 3, 5):  # A leaves before, at and after its last step
                a = make_request("job-1", 8, max_new_tokens=num_new_tokens, ignore_eos=True)
                slot_a = h.loop.submit(a)
                await h.wait(first_output(slot_a))
                h.loop.release(slot_a)  # A's client goes away
                b = make_request("job-1", 9, max_new_tokens=6, ignore_eos=True)
                while True:  # B takes the id the moment it is free
                    try:
                        slot_b = h.loop.submit(b)
                        break
                    except ValueError:  # A's request is still in flight
                        await asyncio.sleep(0)
                stream = await h.wait(read_to_end(h.loop, slot_b))
                assert stream.finish_reason is not FinishReason.CANCELLED
                assert_exact(stream, b)
            assert_idle(h.loop)

    scenario(body)
