"""Each admission round's window and policy, and the reserved head's room, as pure
functions: a queue and the round's facts in, a window out."""

from __future__ import annotations

from pagoda.scheduler_svc.core.admission import (
    WaitingCost,
    admission_window,
    room_for_reserved_head,
)


class Queue:
    """Names in priority order (`head`) and in arrival order (`oldest`), by tenant."""

    def __init__(self, by_priority: list[str], by_arrival: list[str] | None = None) -> None:
        self.by_priority = by_priority
        self.by_arrival = by_arrival or by_priority

    def head(self, num_requests: int, tenant: str | None = None) -> list[str]:
        return [n for n in self.by_priority if tenant is None or n[0] == tenant][:num_requests]

    def oldest(self, num_requests: int, tenant: str | None = None) -> list[str]:
        return [n for n in self.by_arrival if tenant is None or n[0] == tenant][:num_requests]


QUEUE = Queue(["a1", "b1", "a2", "b2", "a3"], ["b2", "a1", "b1", "a2", "a3"])


def test_a_round_reads_as_many_as_it_may_admit_and_pack_its_lookahead():
    assert admission_window(QUEUE, "fifo", 2, 4) == ("fifo", ["a1", "b1"])
    assert admission_window(QUEUE, "priority", 2, 4) == ("priority", ["a1", "b1"])
    assert admission_window(QUEUE, "pack", 2, 4) == ("pack", ["a1", "b1", "a2", "b2"])
    assert admission_window(QUEUE, "prefix", 2, 4) == ("prefix", ["a1", "b1", "a2", "b2"])


def test_fair_share_reads_the_tenants_own_queue():
    assert admission_window(QUEUE, "pack", 1, 4, tenant="b") == ("pack", ["b1", "b2"])


def test_a_forced_round_is_fifo_over_the_oldest_by_arrival_under_priority():
    assert admission_window(QUEUE, "pack", 2, 4, forced=True) == ("fifo", ["a1", "b1"])
    window = admission_window(QUEUE, "priority", 2, 4, forced=True, by_priority=True)
    assert window == ("fifo", ["b2", "a1"])


def test_a_reserved_head_goes_alone_and_fifo_until_it_fits():
    window = admission_window(QUEUE, "pack", 2, 4, forced=True, reserved="a3", tenant="b")
    assert window == ("fifo", ["a3"])


def test_an_isolation_round_reads_only_its_own_requests():
    only = ["b2", "a3", "a2"]
    assert admission_window(QUEUE, "fifo", 2, 4, reserved="a1", only=only) == ("fifo", only[:2])
    assert admission_window(QUEUE, "pack", 1, 2, forced=True, only=only) == ("pack", only[:2])


def test_the_reserved_head_gets_room_only_when_it_fits_a_step_alone():
    head = WaitingCost(10, num_reclaimed_blocks=1)  # 3 new blocks of 4, 1 reclaimed
    assert room_for_reserved_head(head, 10, 4, block_size=4) == 10
    assert room_for_reserved_head(head, 9, 4, block_size=4) == 0  # oversize: it goes alone
    assert room_for_reserved_head(head, 10, 3, block_size=4) == 0  # it waits for blocks
