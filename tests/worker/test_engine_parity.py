"""The paged engine's greedy tokens equal model.generate() of the same weights, token for
token, however the scheduler slices the work: whole prompts, chunked prompts mixed
with decodes, shared prefix blocks, recompute after preemption."""

from __future__ import annotations

import random

import pytest

from tests.worker.conftest import NUM_NEW_TOKENS, TEST_BLOCK_SIZE, TEST_NUM_BLOCKS, random_prompts
from tests.worker.toy_scheduler import ToyScheduler, split_into


@pytest.fixture(params=["reference", "cpu"])
def attention(request) -> str:
    """The attention backend: the reference, and Pagoda's CPU kernel (the worker's `auto`)."""
    if request.param == "cpu":
        from pagoda.gpu_worker import cpu_kernels

        if cpu_kernels.load() is None:
            pytest.skip("Pagoda's CPU kernels cannot be built or run here")
    return request.param


def make_scheduler(tiny_models, attention: str, seed: int = 0) -> ToyScheduler:
    return ToyScheduler(
        tiny_models.engine(attention_backend=attention),
        num_blocks=TEST_NUM_BLOCKS,
        block_size=TEST_BLOCK_SIZE,
        seed=seed,
    )


def expected(tiny_models, prompts: list[list[int]]) -> dict[int, list[int]]:
    return {seq_id: tiny_models.greedy(prompt) for seq_id, prompt in enumerate(prompts)}


def test_batch_of_whole_prompts_matches_generate(tiny_models, attention):
    prompts = random_prompts(6, seed=1)
    scheduler = make_scheduler(tiny_models, attention)
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, prompt)
    assert scheduler.run(NUM_NEW_TOKENS) == expected(tiny_models, prompts)


def test_chunked_prompts_mixed_with_decodes_match_generate(tiny_models, attention):
    prompts = random_prompts(6, seed=2)
    rng = random.Random(2)
    scheduler = make_scheduler(tiny_models, attention, seed=2)
    for seq_id, prompt in enumerate(prompts):
        # Staggered admissions: later prompts' chunks share steps with earlier decodes.
        chunks = split_into(len(prompt), rng.randint(3, 5), rng)
        scheduler.add(seq_id, prompt, chunk_sizes=chunks, admit_at_step=seq_id)
    assert scheduler.run(NUM_NEW_TOKENS) == expected(tiny_models, prompts)
    mixed_steps = [
        r
        for r in scheduler.results
        if r.num_tokens > len(r.seq_ids) and len(r.seq_ids) > 1  # a chunk next to a decode
    ]
    assert mixed_steps, "the scenario should mix prefill chunks and decodes in one step"


def test_prefix_blocks_shared_in_the_same_step_match_generate(tiny_models, attention):
    """Identical prompt prefixes admitted together: the second sequence reads blocks the
    first one writes in the very same forward."""
    (prefix,) = random_prompts(1, seed=3, min_len=22, max_len=22)
    first = prefix + [7, 8, 9]
    second = prefix + [11]  # shares the 5 full blocks (20 tokens) of the first
    scheduler = make_scheduler(tiny_models, attention, seed=3)
    first_job = scheduler.add(0, first)
    second_job = scheduler.add(1, second)
    scheduler.allocate_prompt_blocks(first_job)
    scheduler.share_prefix(second_job, first_job, num_blocks=5)
    result = scheduler.step(lambda job: False)
    assert result.num_tokens == len(first) + len(second) - 20
    assert scheduler.run(NUM_NEW_TOKENS) == expected(tiny_models, [first, second])


def test_prefix_blocks_shared_from_an_earlier_sequence_match_generate(tiny_models, attention):
    (prefix,) = random_prompts(1, seed=4, min_len=17, max_len=17)
    first = prefix + [5]
    second = prefix + [6, 7, 8, 9, 10]
    scheduler = make_scheduler(tiny_models, attention, seed=4)
    first_job = scheduler.add(0, first)
    scheduler.run(4)  # the first sequence is decoding; its prompt blocks are written
    second_job = scheduler.add(1, second)
    scheduler.share_prefix(second_job, first_job, num_blocks=4)
    tokens = scheduler.run(NUM_NEW_TOKENS)
    assert tokens == expected(tiny_models, [first, second])


def test_recompute_from_scratch_matches_generate(tiny_models, attention):
    prompts = random_prompts(3, seed=5)
    scheduler = make_scheduler(tiny_models, attention, seed=5)
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, prompt)
    scheduler.run(NUM_NEW_TOKENS // 2)
    # Preempt sequence 1: forgotten, then recomputed under a new id from prompt +
    # generated-so-far, in two chunks, while the others keep decoding.
    job = scheduler.recompute(1, 101)
    known = len(job.known)
    job.chunk_sizes = [known // 2, known - known // 2]
    tokens = scheduler.run(NUM_NEW_TOKENS)
    assert tokens == {
        0: tiny_models.greedy(prompts[0]),
        101: tiny_models.greedy(prompts[1]),
        2: tiny_models.greedy(prompts[2]),
    }
