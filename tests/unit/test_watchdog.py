"""The scheduler's systemd keep-alives follow its step loop, not merely its process."""

from __future__ import annotations

import asyncio

from pagoda.scheduler_svc import __main__ as scheduler_main


def test_keepalives_stop_while_the_step_loop_is_stuck(monkeypatch):
    sent: list[str] = []
    monkeypatch.setattr(scheduler_main, "notify", lambda *lines: sent.extend(lines) or True)
    monkeypatch.setattr(scheduler_main, "watchdog_interval_s", lambda: 0.001)
    turning = [True] * 3 + [False] * 3 + [True] * 2

    async def scenario() -> None:
        loop_task = asyncio.create_task(asyncio.sleep(3600))
        states = iter(turning)

        def is_turning() -> bool:
            state = next(states, None)
            if state is None:
                loop_task.cancel()
                return False
            return state

        await scheduler_main._watchdog(loop_task, is_turning)

    asyncio.run(scenario())
    assert sent == ["WATCHDOG=1"] * 5
