"""The paged engine's step contract: seeded sampling, refusals, step errors, logprobs."""

from __future__ import annotations

from pagoda.protos import step_pb2
from tests.worker.conftest import TEST_BLOCK_SIZE, TEST_NUM_BLOCKS, random_prompts, run_plan
from tests.worker.toy_scheduler import ToyScheduler


def nucleus(seed: int) -> step_pb2.SamplingParams:
    return step_pb2.SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, repetition_penalty=1.0, seed=seed
    )


def run_seeded(llama_models, prompts, seeds, num_new_tokens=16):
    scheduler = ToyScheduler(
        llama_models.engine(), num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE
    )
    for seq_id, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        scheduler.add(seq_id, prompt, sampling=nucleus(seed))
    return scheduler.run(num_new_tokens)


def test_same_seed_same_tokens_alone_and_in_a_batch_of_eight_others(llama_models):
    prompts = random_prompts(9, seed=11)
    alone = run_seeded(llama_models, prompts[:1], [1234])[0]
    together = run_seeded(llama_models, prompts, [1234, *range(8)])
    assert together[0] == alone
    assert alone != llama_models.greedy(prompts[0])[:16], "sampling should not be greedy"
    other_seed = run_seeded(llama_models, prompts[:1], [4321])[0]
    assert other_seed != alone


def test_same_seed_same_tokens_after_recompute(llama_models):
    (prompt,) = random_prompts(1, seed=12)
    straight = run_seeded(llama_models, [prompt], [99])[0]
    scheduler = ToyScheduler(
        llama_models.engine(), num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE
    )
    scheduler.add(0, prompt, sampling=nucleus(99))
    scheduler.run(7)
    scheduler.recompute(0, 1)
    assert scheduler.run(16)[1] == straight


def one_sequence_plan(step_id, seq_id, tokens, start, block_ids, new=True, **sampling):
    plan = step_pb2.StepPlan(step_id=step_id)
    if new:
        plan.new_sequences.add(
            seq_id=seq_id,
            num_prompt_tokens=len(tokens),
            sampling=step_pb2.SamplingParams(**sampling),
        )
    plan.seq_ids.append(seq_id)
    plan.start_positions.append(start)
    plan.sample.append(True)
    plan.token_offsets.extend([0, len(tokens)])
    plan.token_ids.extend(tokens)
    plan.block_offsets.extend([0, len(block_ids)])
    plan.block_ids.extend(block_ids)
    return plan


def add_entry(plan, seq_id, tokens, start, block_ids):
    plan.seq_ids.append(seq_id)
    plan.start_positions.append(start)
    plan.sample.append(True)
    plan.token_ids.extend(tokens)
    plan.token_offsets.append(len(plan.token_ids))
    plan.block_ids.extend(block_ids)
    plan.block_offsets.append(len(plan.block_ids))


def test_bad_entries_are_refused_while_the_rest_of_the_step_runs(llama_models):
    engine = llama_models.engine()
    prompt = [5, 6, 7, 8, 9]
    plan = one_sequence_plan(1, 1, prompt, 0, [3, 4])
    add_entry(plan, 77, [5], 0, [5])  # unknown sequence
    plan.new_sequences.add(seq_id=2, num_prompt_tokens=2)
    add_entry(plan, 2, [5, 6], 0, [TEST_NUM_BLOCKS])  # block id out of range
    plan.new_sequences.add(seq_id=3, num_prompt_tokens=9)
    add_entry(plan, 3, list(range(9)), 0, [6])  # 9 positions, 4 slots
    result = run_plan(engine, plan)
    assert not result.step_error
    assert list(result.seq_ids) == [1]
    assert list(result.token_ids) == llama_models.greedy(prompt, 1)
    refused = {e.seq_id: e.message for e in result.errors}
    assert set(refused) == {77, 2, 3}
    assert "unknown sequence" in refused[77]
    assert "out of range" in refused[2]
    assert "not covered" in refused[3]
    assert 2 not in engine.table and 3 not in engine.table and 1 in engine.table


def test_failing_forward_reports_step_error_and_forgets_the_plans_sequences(llama_models):
    engine = llama_models.engine(fail_on_token_id=500)
    assert not run_plan(engine, one_sequence_plan(1, 1, [5, 6, 7], 0, [0])).step_error
    plan = one_sequence_plan(2, 2, [5, 500], 0, [1])
    add_entry(plan, 1, [9], 3, [])
    result = run_plan(engine, plan)
    assert "500" in result.step_error
    assert not result.token_ids
    assert 1 not in engine.table and 2 not in engine.table
    # The worker keeps serving.
    again = run_plan(engine, one_sequence_plan(3, 3, [5, 6, 7], 0, [2]))
    assert not again.step_error and list(again.seq_ids) == [3]


def test_logprobs_and_timings_in_the_result(llama_models):
    engine = llama_models.engine()
    plan = one_sequence_plan(1, 1, [5, 6, 7], 0, [0], num_logprobs=3)
    plan.new_sequences.add(seq_id=2, num_prompt_tokens=2, sampling=step_pb2.SamplingParams())
    add_entry(plan, 2, [8, 9], 0, [1])
    result = run_plan(engine, plan)
    assert len(result.logprobs) == 2
    assert list(result.top_offsets) == [0, 3, 3]
    assert result.top_token_ids[0] == result.token_ids[0]  # greedy: the best is the sampled
    assert result.logprobs[0] == result.top_logprobs[0] <= 0
    assert result.num_tokens == 5
    assert result.total_ms >= result.forward_ms > 0


def test_forget_after_the_forward_and_plans_without_tokens(llama_models):
    engine = llama_models.engine()
    plan = one_sequence_plan(1, 1, [5, 6, 7], 0, [0])
    plan.forget_seq_ids.append(1)
    result = run_plan(engine, plan)
    assert list(result.seq_ids) == [1]  # ran, then forgotten
    assert 1 not in engine.table
    empty = run_plan(engine, step_pb2.StepPlan(step_id=2, forget_seq_ids=[1, 42]))
    assert not empty.step_error and not empty.seq_ids and empty.num_tokens == 0


def test_the_paged_engine_keeps_its_docstring():
    from pagoda.gpu_worker.paged_engine import PagedEngine

    assert PagedEngine.__doc__.startswith("Executes step plans on one model and one KV pool.")
