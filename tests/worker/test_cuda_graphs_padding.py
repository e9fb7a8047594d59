"""The CUDA-graph decode path's padded forward, run eagerly on the CPU with the reference
backend: the same static buffers, padding and scratch block as a replay, without the
capture (which needs CUDA). Greedy tokens must equal the plain engine's and generate()'s,
and padded rows may write the scratch block only."""

from __future__ import annotations

import pytest

from tests.worker.conftest import TEST_BLOCK_SIZE, TEST_NUM_BLOCKS, random_prompts
from tests.worker.toy_scheduler import ToyScheduler


def greedy_run(engine, prompts, num_new_tokens=12):
    scheduler = ToyScheduler(engine, num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE)
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, prompt)
    return scheduler.run(num_new_tokens)


@pytest.mark.parametrize("num_prompts", [3, 5])  # buckets 4 and 8: 1 and 3 padded rows
def test_padded_decode_steps_give_the_eager_engines_tokens(llama_models, num_prompts):
    from pagoda.gpu_worker.cuda_graphs import DecodeGraphs, bucket_for, is_decode_only

    prompts = random_prompts(num_prompts, seed=21)
    plain = greedy_run(llama_models.engine(), prompts)
    # One block beyond the scheduler's: the scratch block, as the engine sizes it for graphs.
    engine = llama_models.engine(num_kv_blocks=TEST_NUM_BLOCKS + 1)
    graphs = DecodeGraphs(engine, scratch_block=TEST_NUM_BLOCKS, buckets=(1, 2, 4, 8))
    decode_steps = []

    def every_decode_step(plan):
        decode = is_decode_only(plan)
        if decode:
            decode_steps.append(len(plan.seq_ids))
        return decode

    graphs.fits = every_decode_step  # no graph is captured: run() pads and runs eagerly
    run = graphs.run

    def run_and_check_the_table(plan, fill=None):
        """The static block table: each row gathered from the engine's device table, each
        padded row pointing at the scratch block."""
        logits = run(plan, fill)
        table = graphs._block_table
        for row, seq in enumerate(engine.table.sequences_of(plan.seq_ids)):
            block_ids = seq.block_ids
            assert table[row, : len(block_ids)].tolist() == block_ids
        num_seqs = len(plan.seq_ids)
        bucket = bucket_for(num_seqs, graphs.buckets)
        assert table[num_seqs:bucket, 0].tolist() == [TEST_NUM_BLOCKS] * (bucket - num_seqs)
        return logits

    graphs.run = run_and_check_the_table
    engine.decode_graphs = graphs
    key_cache, _ = engine.pool.layer_blocks(0)
    scratch_before = key_cache[TEST_NUM_BLOCKS].clone()
    padded = greedy_run(engine, prompts)
    assert padded == plain
    assert [padded[i] for i in range(num_prompts)] == [
        llama_models.greedy(prompt)[:12] for prompt in prompts
    ]
    assert num_prompts in decode_steps  # the padded path ran
    # Padded rows wrote their K/V into the scratch block (into a real block, the tokens
    # above would differ).
    assert not key_cache[TEST_NUM_BLOCKS].equal(scratch_before)
