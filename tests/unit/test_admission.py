"""Admission policies as pure functions: costs and a budget in, admissions out."""

from __future__ import annotations

from pagoda.scheduler_svc.core.admission import (
    Admission,
    AdmissionBudget,
    WaitingCost,
    admit_deadline,
    admit_fifo,
    admit_pack,
    admit_prefix,
    admit_priority,
    is_fifo_round,
    prefill_cost,
)


def budget(
    num_tokens: int = 100,
    *,
    num_step_tokens: int | None = None,
    num_requests: int = 100,
    num_blocks: int = 1000,
    block_size: int = 4,
    chunked_prefill: bool = False,
    first_round: bool = True,
) -> AdmissionBudget:
    return AdmissionBudget(
        num_tokens=num_tokens,
        num_step_tokens=num_tokens if num_step_tokens is None else num_step_tokens,
        num_requests=num_requests,
        num_blocks=num_blocks,
        block_size=block_size,
        chunked_prefill=chunked_prefill,
        first_round=first_round,
    )


def costs(*num_tokens: int) -> list[WaitingCost]:
    return [WaitingCost(n) for n in num_tokens]


def test_fifo_respects_the_prefill_token_budget():
    assert admit_fifo(costs(40, 40, 40), budget(100)) == [Admission(0, 40), Admission(1, 40)]


def test_fifo_stops_at_the_first_that_does_not_fit():
    # The third would fit, but FIFO never overtakes.
    assert admit_fifo(costs(40, 70, 10), budget(100)) == [Admission(0, 40)]


def test_fifo_with_chunked_prefill_fills_the_rest_with_a_chunk():
    assert admit_fifo(costs(40, 70, 10), budget(100, chunked_prefill=True)) == [
        Admission(0, 40),
        Admission(1, 60),
    ]


def test_an_oversize_head_is_admitted_alone():
    assert admit_fifo(costs(500, 10), budget(100)) == [Admission(0, 500)]


def test_an_oversize_head_with_chunked_prefill_gets_its_first_chunk():
    assert admit_fifo(costs(500, 10), budget(100, chunked_prefill=True)) == [Admission(0, 100)]


def test_a_head_that_fits_an_empty_step_waits_for_room():
    # 80 tokens fit a step of 100, just not the 30 left after decodes: it waits.
    assert admit_fifo(costs(80), budget(30, num_step_tokens=100)) == []


def test_an_oversize_head_goes_alone_only_in_the_first_round():
    assert admit_fifo(costs(500), budget(100, first_round=False)) == []


def test_fifo_counts_blocks_too():
    # 10 tokens in blocks of 4 take 3 blocks; two requests need 6 of the 5 free.
    assert admit_fifo(costs(10, 10), budget(100, num_blocks=5)) == [Admission(0, 10)]


def test_a_chunk_is_cut_to_the_free_blocks():
    assert admit_fifo(costs(40), budget(100, num_blocks=3, chunked_prefill=True)) == [
        Admission(0, 12)
    ]


def test_reclaimed_prefix_blocks_count_against_the_pool():
    waiting = [WaitingCost(4, num_reclaimed_blocks=2)]
    assert admit_fifo(waiting, budget(100, num_blocks=2)) == []
    assert admit_fifo(waiting, budget(100, num_blocks=3)) == [Admission(0, 4)]


def test_the_request_cap_clamps_admission():
    assert admit_fifo(costs(1, 1, 1), budget(100, num_requests=2)) == [
        Admission(0, 1),
        Admission(1, 1),
    ]
    assert admit_fifo(costs(1, 1, 1), budget(100, num_requests=0)) == []


def test_pack_skips_an_oversize_head_and_admits_the_short_ones_in_arrival_order():
    waiting = costs(500, 30, 20, 60, 10)
    assert admit_pack(waiting, budget(100), lookahead=16) == [
        Admission(1, 30),
        Admission(2, 20),
        Admission(4, 10),
    ]


def test_pack_looks_only_within_the_lookahead():
    assert admit_pack(costs(500, 500, 10), budget(100), lookahead=2) == [Admission(0, 500)]


def test_pack_still_progresses_when_every_request_is_oversize():
    assert admit_pack(costs(500, 400, 300), budget(100), lookahead=16) == [Admission(0, 500)]
    assert admit_pack(costs(500, 400), budget(100, chunked_prefill=True), lookahead=16) == [
        Admission(0, 100)
    ]


def test_pack_falls_back_only_in_the_first_round():
    assert admit_pack(costs(500), budget(100, first_round=False), lookahead=16) == []


def test_priority_admits_lower_values_first_and_ties_in_arrival_order():
    waiting = [WaitingCost(10, priority=p) for p in (5, 1, 3, 1)]
    assert admit_priority(waiting, budget(30)) == [
        Admission(1, 10),
        Admission(3, 10),
        Admission(2, 10),
    ]


def cached(*pairs: tuple[int, int]) -> list[WaitingCost]:
    """(tokens to compute, cached tokens) per request."""
    return [WaitingCost(n, num_cached_tokens=c) for n, c in pairs]


def test_prefix_admits_the_longest_cached_prefix_first_ties_in_arrival_order():
    window = cached((40, 0), (10, 64), (20, 32), (10, 64))
    assert admit_prefix(window, budget(100), lookahead=16) == [
        Admission(1, 10),
        Admission(3, 10),
        Admission(2, 20),
        Admission(0, 40),
    ]


def test_prefix_stops_at_the_first_that_does_not_fit_and_keeps_to_its_lookahead():
    # The fourth holds the longest prefix but lies beyond the lookahead.
    window = cached((40, 0), (70, 64), (40, 32), (10, 128))
    assert admit_prefix(window, budget(100), lookahead=3) == [Admission(1, 70)]
    assert admit_prefix(window, budget(100, chunked_prefill=True), lookahead=3) == [
        Admission(1, 70),
        Admission(2, 30),
    ]


def test_deadline_admits_the_earliest_deadline_first_and_those_without_last():
    inf = float("inf")
    window = [WaitingCost(10, deadline_s=d) for d in (inf, 30.0, 12.5, inf, 12.5, 99.0)]
    assert admit_deadline(window, budget(100), lookahead=16) == [
        Admission(2, 10),
        Admission(4, 10),
        Admission(1, 10),
        Admission(5, 10),
        Admission(0, 10),
        Admission(3, 10),
    ]
    # Within its lookahead only, and the first that does not fit ends the round.
    window = [WaitingCost(60, deadline_s=9.0), WaitingCost(50, deadline_s=5.0)]
    assert admit_deadline(window, budget(100), lookahead=1) == [Admission(0, 60)]
    assert admit_deadline(window, budget(100), lookahead=2) == [Admission(1, 50)]


def test_force_fifo_rounds_happen_on_schedule():
    assert [n for n in range(1, 10) if is_fifo_round(n, 3)] == [3, 6, 9]
    assert not any(is_fifo_round(n, None) or is_fifo_round(n, 0) for n in range(1, 10))


def test_cost_is_the_uncached_tokens_clamped_to_the_context():
    assert prefill_cost(100, 32, max_context_tokens=4096) == 68
    assert prefill_cost(9000, 0, max_context_tokens=4096) == 4096


def test_fifo_prices_only_what_it_reads():
    priced = []

    class Lazy(list):
        def __getitem__(self, index):
            priced.append(index)
            return super().__getitem__(index)

    admit_fifo(Lazy(costs(60, 60, 1, 1, 1)), budget(100))
    assert priced == [0, 1]
