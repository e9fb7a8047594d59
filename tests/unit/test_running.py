from __future__ import annotations

from types import SimpleNamespace

from pagoda.scheduler_svc.core.running import RunningSet


def sequence(seq_id: int, *, priority: int = 0, num_computed_tokens: int = 5, to_feed: int = 0):
    return SimpleNamespace(
        request_id=f"r{seq_id}",
        seq_id=seq_id,
        admit_order=seq_id,
        priority=priority,
        num_computed_tokens=num_computed_tokens,
        num_tokens_to_feed=to_feed,
        last_scheduled_step=-1,
    )


def running(*requests, by_priority: bool = False) -> RunningSet:
    sequences = RunningSet(by_priority)
    for request in requests:
        sequences.requests[request.seq_id] = request
        sequences.fed(request)
    return sequences


def ids(requests) -> list[int]:
    return [request.seq_id for request in requests]


def test_decoders_are_the_running_sequences_past_their_prompt_in_admission_order():
    sequences = running(sequence(1), sequence(2, to_feed=7), sequence(3))
    assert ids(sequences.decoders(None)) == [1, 3]
    assert ids(sequences.decoders({"r3": None, "r2": None})) == [3]
    sequences.remove(2)
    assert set(sequences.requests) == {1, 3} and not sequences.prefilling


def test_under_a_cap_decoders_take_turns_after_the_last_one_served():
    sequences = running(*[sequence(seq_id) for seq_id in range(1, 6)])
    decoders = sequences.decoders(None)
    assert ids(sequences.round_robin(decoders, 2)) == [1, 2, 3, 4, 5]
    assert ids(sequences.round_robin(decoders, 2)) == [3, 4, 5, 1, 2]
    # The turn wraps; the chosen ones go in feed order, the rest follow in case of preemption.
    assert ids(sequences.round_robin(decoders, 2)) == [1, 5, 2, 3, 4]


def test_under_priority_the_chosen_ones_are_fed_lowest_value_first():
    sequences = running(sequence(1, priority=3), sequence(2, priority=1), by_priority=True)
    assert ids(sequences.round_robin(sequences.decoders(None), 2)) == [2, 1]


def test_decoders_at_a_block_boundary_need_a_block_unless_fed_this_step():
    fed = sequence(3, num_computed_tokens=8)
    fed.last_scheduled_step = 7
    sequences = running(
        sequence(1, num_computed_tokens=8),
        sequence(2, num_computed_tokens=9),
        fed,
        sequence(4, num_computed_tokens=4),
        sequence(5, num_computed_tokens=4, to_feed=3),  # prefilling
    )
    assert sequences.num_at_block_boundary(4, step_id=7) == 2  # 1 and 4
    assert sequences.num_at_block_boundary(4, step_id=7, before=sequences.requests[4]) == 1
    sequences.clear()
    assert sequences.num_at_block_boundary(4, step_id=7) == 0


def test_to_decode_is_round_robin_over_the_cap_else_feed_order():
    sequences = running(sequence(1, priority=3), sequence(2, priority=1), by_priority=True)
    assert ids(sequences.to_decode(None, cap=2)) == [2, 1]
    assert ids(sequences.to_decode(None, cap=1)) == [1, 2]  # 1's turn, then 2 if preempted
    assert ids(sequences.to_decode(None, cap=1)) == [2, 1]
    assert ids(sequences.to_decode({"r1": None}, cap=1)) == [1]
    plain = running(sequence(1), sequence(2, to_feed=3), sequence(3))
    assert ids(plain.to_decode(None, cap=5)) == [1, 3]


def test_an_ended_sequence_leaves_the_set_with_its_sequence_fields_cleared():
    ended = sequence(2, to_feed=7)
    ended.block_ids, ended.num_blocks_sent = [4, 5], 2
    sequences = running(sequence(1), ended)
    sequences.end(ended)
    assert set(sequences.requests) == {1} and not sequences.prefilling
    assert (ended.seq_id, ended.block_ids, ended.num_blocks_sent) == (None, [], 0)
    assert ended.num_computed_tokens == 0
