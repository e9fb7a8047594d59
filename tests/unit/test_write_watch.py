"""The write watch ends writes its client does not take, and only those."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.scheduler_svc.write_watch import StalledWrite, WriteWatch


class ManualClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


async def turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def test_a_write_not_taken_within_the_limit_ends_as_stalled_and_a_quick_one_returns():
    async def scenario() -> None:
        clock = ManualClock()
        watch = WriteWatch(limit_s=0.04, clock=clock)
        never_taken = asyncio.get_running_loop().create_future()
        stalled = asyncio.create_task(watch.write(never_taken))
        quick = asyncio.create_task(watch.write(asyncio.sleep(0)))
        await quick  # returns, and leaves nothing behind
        clock.now_s = 0.05  # past the limit for the stalled one
        with pytest.raises(StalledWrite):
            await asyncio.wait_for(stalled, timeout=5)
        assert never_taken.cancelled()
        assert not watch._started_s and not watch._ended
        # The task that got StalledWrite is not left cancelled: it can still abort.
        assert not stalled.cancelled()
        watch.close()

    asyncio.run(scenario())


def test_a_write_within_the_limit_is_never_ended():
    async def scenario() -> None:
        clock = ManualClock()
        watch = WriteWatch(limit_s=0.04, clock=clock)
        slow = asyncio.get_running_loop().create_future()
        writer = asyncio.create_task(watch.write(slow))
        await asyncio.sleep(0.05)  # several sweeps, at a time still inside the limit
        assert not writer.done()
        slow.set_result(None)
        await writer
        watch.close()

    asyncio.run(scenario())


def test_a_cancel_from_elsewhere_stays_a_cancel():
    """The client leaving (or a deadline) cancels the handler: that is not a stall."""

    async def scenario() -> None:
        watch = WriteWatch(limit_s=60.0)
        writer = asyncio.create_task(watch.write(asyncio.get_running_loop().create_future()))
        await turns(2)
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer
        assert not watch._started_s
        watch.close()

    asyncio.run(scenario())
