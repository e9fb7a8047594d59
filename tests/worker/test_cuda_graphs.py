"""CUDA-graph bucketing and padding (pure Python; capture and replay need CUDA and are
not tested here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagoda.gpu_worker.cuda_graphs import (
    DECODE_BUCKETS,
    PAD_TOKEN_ID,
    bucket_for,
    can_capture,
    is_decode_only,
    pad_decode,
)


def test_the_buckets_are_powers_of_two_to_8_then_every_8_to_256():
    assert DECODE_BUCKETS[:6] == (1, 2, 4, 8, 16, 24)
    assert DECODE_BUCKETS[-1] == 256
    assert all(b - a == 8 for a, b in zip(DECODE_BUCKETS[3:], DECODE_BUCKETS[4:], strict=False))


@pytest.mark.parametrize(
    ("num_seqs", "bucket"),
    [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (16, 16), (17, 24), (100, 104),
     (249, 256), (256, 256), (257, None), (0, None)],
)  # fmt: skip
def test_a_batch_goes_to_the_smallest_bucket_that_holds_it(num_seqs, bucket):
    assert bucket_for(num_seqs) == bucket


def test_every_batch_size_wastes_less_than_a_bucket_step():
    for num_seqs in range(1, 257):
        bucket = bucket_for(num_seqs)
        assert num_seqs <= bucket and (bucket - num_seqs < 8 or bucket <= 8)


def test_real_rows_keep_their_slots_and_padded_rows_touch_only_the_scratch_block():
    block_size, scratch = 4, 99
    padded = pad_decode(
        [11, 12, 13],
        [5, 0, 8],  # block 1 offset 1; block 0 offset 0; block 2 offset 0
        [[7, 3], [5], [2, 6, 9]],
        block_size=block_size,
        bucket=4,
        width=3,
        scratch_block=scratch,
    )
    assert (padded.bucket, padded.num_seqs) == (4, 3)
    assert padded.input_ids == [11, 12, 13, PAD_TOKEN_ID]
    assert padded.positions == [5, 0, 8, 0]
    assert padded.slot_mapping == [3 * 4 + 1, 5 * 4 + 0, 9 * 4 + 0, scratch * 4]
    assert padded.context_lens == [6, 1, 9, 1]


def test_a_padded_row_reads_nothing_but_the_scratch_slot_it_writes():
    padded = pad_decode([1], [0], [[0]], block_size=16, bucket=8, width=2, scratch_block=40)
    for row in range(1, 8):
        assert padded.context_lens[row] == 1  # reads position 0 of its table: the scratch
        assert padded.slot_mapping[row] == 40 * 16


@pytest.mark.parametrize(
    ("rows", "bucket", "width"),
    [
        (([1, 2], [0, 0], [[0], [1]]), 1, 1),  # more rows than the bucket
        (([1], [8], [[0, 1]]), 1, 2),  # position 8 needs a third block
        (([1], [4], [[0, 1]]), 1, 1),  # wider than the graph's table
    ],
)
def test_what_does_not_fit_is_refused(rows, bucket, width):
    with pytest.raises(ValueError):
        pad_decode(*rows, block_size=4, bucket=bucket, width=width, scratch_block=9)


def test_only_cuda_with_a_kernel_only_backend_is_captured():
    assert can_capture("triton", "cuda")
    assert not can_capture("reference", "cuda")  # its forward loops on the host
    assert not can_capture("triton", "cpu")


def test_only_steps_whose_every_chunk_feeds_one_token_and_samples_are_replayed():
    """A graph's logits hold a row for every chunk, and the engine samples each: a
    one-token chunk inside a prompt (cut where blocks run short) samples nothing, so a
    step holding one runs eagerly (it once took the graph and sampled one token too many,
    which failed the step)."""

    def plan(*rows):
        """An admitted plan of rows (token_ids, sample)."""
        token_ids = [t for tokens, _ in rows for t in tokens]
        return SimpleNamespace(seq_ids=list(range(len(rows))), token_ids=token_ids,
                               sample=[sample for _, sample in rows])  # fmt: skip

    assert is_decode_only(plan(([5], True), ([6], True)))
    assert not is_decode_only(plan(([5], True), ([6], False)))
    assert not is_decode_only(plan(([5, 6], True)))
