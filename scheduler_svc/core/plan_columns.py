"""Writing sequences into a StepDecision's columns, and keying the blocks they complete.

Called by the step planner only. Feeding a request advances its num_computed_tokens
now: the step in flight counts as computed (a failed step requeues its sequences).
"""

from __future__ import annotations

from pagoda.scheduler_svc.core.prefix_cache import extend_block_hashes
from pagoda.scheduler_svc.core.request import Request
from pagoda.scheduler_svc.core.sequence_state import SequenceState
from pagoda.scheduler_svc.core.step_decision import StepDecision


def feed(state: SequenceState, decision: StepDecision, request: Request, num_tokens: int) -> None:
    """Put the request's next `num_tokens` tokens, and its unsent blocks, in the decision."""
    start = request.num_computed_tokens
    end = start + num_tokens
    token_ids, table = request.token_ids, request.block_ids
    decision.seq_ids.append(request.seq_id)
    decision.start_positions.append(start)
    decision.sample.append(end == len(token_ids))
    decision.token_ids.extend(token_ids[start:end])
    decision.token_offsets.append(len(decision.token_ids))
    decision.block_ids.extend(table[request.num_blocks_sent :])
    decision.block_offsets.append(len(decision.block_ids))
    request.num_blocks_sent = len(table)
    request.num_computed_tokens = end
    request.last_scheduled_step = decision.step_id
    if end < len(token_ids):
        state.prefilling[request.seq_id] = request
    else:
        state.prefilling.pop(request.seq_id, None)
    if state.config.prefix_caching:
        key_blocks(state, request, start, end)


def feed_decodes(
    state: SequenceState,
    decision: StepDecision,
    fed: list[Request],
    positions: list[int],
    grown_indices: list[int],
    completing: list[int],
) -> None:
    """The columns of decoding sequences `fed`, each feeding its last token at
    `positions[i]`. The planner already advanced their counters and gave a new block to
    those at `grown_indices` (ascending); the others have sent their whole table. Those
    at `completing` fill their last block: it is keyed for the prefix cache.

    The hot path: comprehensions rather than one append per column per sequence; only
    the 1/block_size that grew or complete a block are visited one by one.
    """
    num_fed = len(fed)
    decision.seq_ids.extend([request.seq_id for request in fed])
    decision.start_positions.extend(positions)
    decision.sample.extend([True] * num_fed)
    token_ids = decision.token_ids
    base = len(token_ids)
    token_ids.extend([request.last_token_id for request in fed])
    decision.token_offsets.extend(counting_numbers(base + 1, base + num_fed + 1))
    block_ids, block_offsets = decision.block_ids, decision.block_offsets
    done = 0
    for index in grown_indices:
        block_offsets.extend([len(block_ids)] * (index - done))
        request = fed[index]
        table = request.block_ids
        block_ids.extend(table[request.num_blocks_sent :])
        request.num_blocks_sent = len(table)
        block_offsets.append(len(block_ids))
        done = index + 1
    block_offsets.extend([len(block_ids)] * (num_fed - done))
    for index in completing:
        key_blocks(state, fed[index], positions[index], positions[index] + 1)


_counting_numbers: list[int] = []


def counting_numbers(start: int, stop: int) -> list[int]:
    """list(range(start, stop)) made of shared int objects: a step's token offsets would
    otherwise allocate one new int per sequence (about 50 us a step at 1,000 sequences)."""
    if stop > len(_counting_numbers):
        _counting_numbers.extend(range(len(_counting_numbers), 2 * stop))
    return _counting_numbers[start:stop]


def key_blocks(state: SequenceState, request: Request, start: int, end: int) -> None:
    """Key the blocks that positions [start, end) complete: the worker writes them before
    any read in this step, so a later admission of this step may share them."""
    blocks = state.blocks
    block_size = blocks.block_size
    first, last = start // block_size, end // block_size
    if first == last:
        return
    extend_block_hashes(request.token_ids, request.block_hashes, last, block_size)
    for index in range(first, last):
        block_id = request.block_ids[index]
        if blocks.register(block_id, request.block_hashes[index]):
            state.keyed_in_flight.append((request.seq_id, block_id))
