"""The `cpu` attention backend (Pagoda's C kernel, gpu_worker/attention/cpu.py) computes the
reference backend's attention, and each row's bits depend on nothing but its own query,
keys and values."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagoda.gpu_worker import cpu_kernels
from pagoda.gpu_worker.attention import create_backend
from pagoda.gpu_worker.attention.backend import AttentionMetadata
from pagoda.gpu_worker.attention.cpu import CpuBackend
from pagoda.gpu_worker.attention.reference import ReferenceBackend

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="Pagoda's CPU kernels cannot be built or run here"
)

# (keys cached before the step, rows this step): decode rows first, then chunks that
# continue earlier keys, then prompts from position 0.
MIXED = [(40, 1), (0, 1), (300, 1), (17, 1), (64, 37), (5, 3), (0, 70), (0, 1)]


def step_of(sequences, num_kv_heads, group, head_dim, block_size, seed=0):
    """Random keys and values for every position at scattered blocks; returns (query, key,
    value, key_cache, value_cache, metadata), this step's key/value being what the cache
    already holds at their slots (so write_kv leaves it as it is)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [prior + rows for prior, rows in sequences]
    num_blocks = [-(-length // block_size) for length in lengths]
    total = sum(num_blocks) + 1
    shape = (total, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator)
    value_cache = torch.randn(shape, generator=generator)
    free = (torch.randperm(total - 1, generator=generator) + 1).tolist()
    table = torch.zeros(len(sequences), max(num_blocks) + 1, dtype=torch.int32)
    slots = []
    for index, ((prior, rows), blocks) in enumerate(zip(sequences, num_blocks, strict=True)):
        ids = [free.pop() for _ in range(blocks)]
        table[index, :blocks] = torch.tensor(ids, dtype=torch.int32)
        slots += [
            ids[p // block_size] * block_size + p % block_size for p in range(prior, prior + rows)
        ]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    flat = key_cache.view(-1, num_kv_heads, head_dim)
    key, value = flat[slot_mapping], value_cache.view(-1, num_kv_heads, head_dim)[slot_mapping]
    query = torch.randn(len(slots), num_kv_heads * group, head_dim, generator=generator)
    starts = torch.tensor([0] + [rows for _, rows in sequences], dtype=torch.int32).cumsum(0)
    starts = starts.to(torch.int32)
    context_lens = torch.tensor(lengths, dtype=torch.int32)
    num_decode = 0  # the leading one-row sequences; a later one is a one-token prompt
    while num_decode < len(sequences) and sequences[num_decode][1] == 1:
        num_decode += 1
    metadata = AttentionMetadata(
        num_tokens=len(slots),
        num_seqs=len(sequences),
        num_decode_seqs=num_decode,
        max_query_len=max(rows for _, rows in sequences),
        max_context_len=max(lengths),
        max_decode_context_len=max(lengths[:num_decode], default=0),
        block_size=block_size,
        query_start_loc=starts,
        context_lens=context_lens,
        block_table=table,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=starts,
        context_lens_cpu=context_lens,
    )
    return query, key, value, key_cache, value_cache, metadata


def run(backend, step, scale=0.25, **options):
    query, key, value, key_cache, value_cache, metadata = step
    backend.write_kv(key, value, key_cache, value_cache, metadata)
    return backend.forward(
        query, key, value, key_cache, value_cache, metadata, scale=scale, **options
    )


@pytest.mark.parametrize("block_size", [1, 16, 48])
@pytest.mark.parametrize(
    "num_kv_heads, group, head_dim", [(2, 3, 16), (1, 1, 64), (3, 4, 72), (2, 2, 128)]
)
@pytest.mark.parametrize("options", [{}, {"sliding_window": 24}, {"softcap": 5.0}])
def test_the_kernel_computes_the_reference_attention(
    block_size, num_kv_heads, group, head_dim, options
):
    step = step_of(MIXED, num_kv_heads, group, head_dim, block_size)
    backend = CpuBackend()
    assert backend.uses_kernel
    got = run(backend, step, **options)
    expected = run(ReferenceBackend(), step, **options)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def one_row(metadata: AttentionMetadata, seq: int, row: int, position: int) -> AttentionMetadata:
    """Row `row` of `metadata`'s step (sequence `seq`, at `position`) as a decode step alone."""
    starts = torch.tensor([0, 1], dtype=torch.int32)
    context_lens = torch.tensor([position + 1], dtype=torch.int32)
    return AttentionMetadata(
        num_tokens=1,
        num_seqs=1,
        num_decode_seqs=1,
        max_query_len=1,
        max_context_len=position + 1,
        max_decode_context_len=position + 1,
        block_size=metadata.block_size,
        query_start_loc=starts,
        context_lens=context_lens,
        block_table=metadata.block_table[seq : seq + 1],
        slot_mapping=metadata.slot_mapping[row : row + 1],
        query_start_loc_cpu=starts,
        context_lens_cpu=context_lens,
    )


def test_a_rows_bits_are_its_own_alone_in_a_batch_and_as_the_end_of_a_chunk():
    batch = [(40, 1), (300, 1), (17, 1), (64, 37), (0, 70)]
    step = step_of(batch, num_kv_heads=3, group=3, head_dim=64, block_size=16, seed=3)
    together = run(CpuBackend(), step)
    query, key, value, key_cache, value_cache, metadata = step
    # (sequence, its row in the step, that row's position): the three decode rows, and the
    # last row of the 37-row chunk computed as a decode row of its sequence.
    for seq, row, position in [(0, 0, 40), (1, 1, 300), (2, 2, 17), (3, 3 + 36, 64 + 36)]:
        rows = slice(row, row + 1)
        alone = CpuBackend().forward(
            query[rows],
            key[rows],
            value[rows],
            key_cache,
            value_cache,
            one_row(metadata, seq, row, position),
            scale=0.25,
        )
        assert torch.equal(alone[0], together[row]), (seq, row)


def test_the_thread_count_does_not_change_a_bit():
    step = step_of(MIXED[:4] + MIXED[4:7], 2, 3, 64, 16, seed=4)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            outputs.append(run(CpuBackend(), step))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(output, outputs[0]) for output in outputs)


@pytest.mark.parametrize("block_size", [1, 16, 48])
@pytest.mark.parametrize(
    "num_kv_heads, group, head_dim",
    # 64/128/256: values four 512-bit registers a chunk; 72, 96: q.k only; group 20: parts
    [(3, 3, 64), (8, 2, 128), (2, 4, 256), (3, 4, 72), (2, 5, 96), (1, 20, 64), (4, 1, 64)],
)
@pytest.mark.parametrize("options", [{}, {"sliding_window": 24, "softcap": 5.0}])
def test_the_avx512_loops_give_the_avx2_loops_bits(
    block_size, num_kv_heads, group, head_dim, options
):
    """q.k two keys a 512-bit register and P.V the heads of a row together: each lane still
    runs the AVX2 lane's chain, so a row's bits are the same either way."""
    kernels = cpu_kernels.load()
    if not kernels.avx512():
        pytest.skip("this CPU has no AVX-512: only the AVX2 loops run")
    step = step_of(MIXED + [(127, 1)] * 3, num_kv_heads, group, head_dim, block_size, seed=5)
    wide = run(CpuBackend(), step, **options)
    try:
        assert not kernels.avx512(False)
        narrow = run(CpuBackend(), step, **options)
    finally:
        assert kernels.avx512(True)
    assert torch.equal(wide, narrow)


@pytest.mark.parametrize(
    "num_kv_heads, head_dim, strided",
    [(3, 64, True), (2, 128, False), (2, 20, True), (1, 72, False)],  # 20, 72: not whole lines
)
def test_the_kernel_writes_the_new_keys_and_values_where_the_reference_does(
    num_kv_heads, head_dim, strided
):
    generator = torch.Generator().manual_seed(head_dim)
    shape = (40, 16, num_kv_heads, head_dim)
    rows = 37
    width = num_kv_heads * head_dim
    # Strided: the k and v columns of one wider projection output, as the model hands them.
    joined = torch.randn(rows, 3 * width if strided else 2 * width, generator=generator)
    key = joined[:, :width].view(rows, num_kv_heads, head_dim)
    value = joined[:, width : 2 * width].view(rows, num_kv_heads, head_dim)
    slots = torch.randperm(40 * 16, generator=generator)[:rows]
    metadata = step_of([(0, 1)], num_kv_heads, 1, head_dim, 16)[-1]
    metadata = dataclasses.replace(metadata, slot_mapping=slots)
    expected = (torch.zeros(shape), torch.zeros(shape))
    ReferenceBackend().write_kv(key, value, *expected, metadata)
    got = (torch.zeros(shape), torch.zeros(shape))
    CpuBackend().write_kv(key, value, *got, metadata)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_what_the_kernel_does_not_take_runs_on_the_reference():
    step = step_of([(10, 1), (0, 9)], 2, 2, 20, 16)  # head size not a multiple of 8
    torch.testing.assert_close(run(CpuBackend(), step), run(ReferenceBackend(), step))


def test_auto_takes_the_kernel_on_a_cpu():
    assert create_backend("auto", "cpu", 16).name == "cpu"
    assert create_backend("cpu", "cpu", 16).uses_kernel
