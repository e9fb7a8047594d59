"""The warm-up at load (gpu_worker/warm_up.py): its plans cover every split-KV segment
count and the prefill tile, fit the pool, and leave the engine as it was (run here on the
CPU engine, whose steps are the same; on CUDA load_engine runs them after the capture)."""

from __future__ import annotations

import pytest
import torch

from pagoda.gpu_worker.warm_up import PREFILL_CHUNK_TOKENS, decode_batch_sizes, warm_up_plans
from tests.worker.conftest import TEST_BLOCK_SIZE, TEST_NUM_BLOCKS, random_prompts
from tests.worker.toy_scheduler import ToyScheduler


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3, 8, 16])
def test_decode_sizes_cover_every_segment_count_of_the_triton_backend(num_kv_heads):
    triton_paged = pytest.importorskip("pagoda.gpu_worker.attention.triton_paged")
    cuda = torch.device("cuda")  # the split applies on CUDA only; no GPU is touched

    def segments_for(num_seqs: int) -> int:
        return triton_paged.split_kv_segments(num_seqs, num_kv_heads, 1, cuda)

    sizes = decode_batch_sizes(segments_for, max_num_seqs=2048)
    every = {segments_for(n) for n in range(1, 2049)}
    assert {segments_for(n) for n in sizes} == every
    assert len(sizes) == len(every) and sizes[0] == 1 and segments_for(sizes[-1]) == 1


def test_decode_sizes_stop_at_the_largest_batch():
    assert decode_batch_sizes(lambda n: 32 if n < 100 else 1, max_num_seqs=50) == [1]


def test_plans_fit_the_pool_and_forget_their_sequences():
    plans = warm_up_plans([1, 2, 4], PREFILL_CHUNK_TOKENS, block_size=16, num_kv_blocks=4)
    # 1, 2 and 4 one-token sequences fit 4 blocks; the 64-token chunk needs 4 too.
    assert [len(p.seq_ids) for p in plans] == [1, 2, 4, 1]
    assert len(plans[-1].token_ids) == PREFILL_CHUNK_TOKENS
    for plan in plans:
        assert sorted(plan.forget_seq_ids) == sorted(plan.seq_ids)
        assert max(plan.block_ids) < 4
    assert len(warm_up_plans([8], 64, block_size=16, num_kv_blocks=3)) == 0


def test_warm_up_steps_leave_the_engine_as_it_was(llama_models):
    engine = llama_models.engine()
    plans = warm_up_plans([1, 3, 8], 20, TEST_BLOCK_SIZE, TEST_NUM_BLOCKS)
    for plan in plans:
        result = engine.step(plan)
        assert not result.step_error, result.step_error
    assert len(engine.table) == 0
    scheduler = ToyScheduler(engine, num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE)
    prompts = random_prompts(3, seed=31)
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, prompt)
    assert scheduler.run(5) == {i: llama_models.greedy(p, 5) for i, p in enumerate(prompts)}
