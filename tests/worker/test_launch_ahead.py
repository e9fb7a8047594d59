"""Steps launched ahead (gpu_worker/engine.py): step N+1 is admitted and enqueued before
step N is read, its placeholder rows fed N's tokens on the device. On the CPU the work
is done when launched, so nothing overlaps here, but the bookkeeping is the same code
as on CUDA: the tokens, logprobs and histories must be those of serial steps, and the
failures must stay where they were."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.common.step import NewSequence, SamplingParams, StepPlan
from pagoda.gpu_worker.sequence_table import PENDING_TOKEN
from tests.worker.conftest import TEST_BLOCK_SIZE, TEST_NUM_BLOCKS, random_prompts


@dataclass
class Job:
    seq_id: int
    prompt: list[int]
    sampling: SamplingParams
    chunks: list[int]  # prompt chunk sizes still to feed (then the rest at once)
    admit_at: int  # the plan that first feeds it
    generated: list[int] = field(default_factory=list)  # read back
    logprobs: list[float] = field(default_factory=list)
    num_fed: int = 0  # positions fed by the plans launched so far
    num_sampling: int = 0  # tokens it will have once every launched plan is read
    blocks: list[int] = field(default_factory=list)
    num_blocks_sent: int = 0
    forgotten: bool = False


class Driver:
    """A scheduler in miniature: with `ahead`, plan N+1 and launch it before N is read
    (placeholders for N's tokens), when the engine allows; else one step at a time."""

    def __init__(self, engine, *, ahead: bool, num_new_tokens: int, forget: bool = True) -> None:
        self.engine = engine
        engine.launches_ahead = ahead  # as --launch-ahead on sets it
        self.ahead = ahead
        self.forget = forget
        self.num_new_tokens = num_new_tokens
        self.jobs: list[Job] = []
        self.free_blocks = list(range(TEST_NUM_BLOCKS - 1, -1, -1))
        self.num_plans = 0
        self.results = []
        self.num_launched_ahead = 0

    def add(self, seq_id, prompt, sampling=None, chunks=(), admit_at=0) -> None:
        self.jobs.append(Job(seq_id, prompt, sampling or SamplingParams(), list(chunks), admit_at))

    def _wants(self, job: Job) -> bool:
        return job.admit_at <= self.num_plans and job.num_sampling < self.num_new_tokens

    def plan(self) -> StepPlan:
        plan = StepPlan(step_id=self.num_plans)
        for job in self.jobs:
            if self.forget and not job.forgotten and job.num_sampling >= self.num_new_tokens:
                plan.forget_seq_ids.append(job.seq_id)  # planned to the end: forget now
                job.forgotten = True
            if not self._wants(job):
                continue
            if job.num_fed == 0:
                plan.new_sequences.append(NewSequence(job.seq_id, job.sampling, len(job.prompt)))
            start = job.num_fed
            if start < len(job.prompt):
                size = job.chunks.pop(0) if job.chunks else len(job.prompt) - start
                fed = job.prompt[start : start + size]  # a chunk may run past the prompt
                samples = start + len(fed) == len(job.prompt)
            else:
                index = start - len(job.prompt)
                known = index < len(job.generated)
                fed = [job.generated[index] if known else 0]
                samples = True
                if not known:  # sampled by the step not read yet: a placeholder
                    plan.last_sampled_rows.append(len(plan.seq_ids))
            while len(job.blocks) * TEST_BLOCK_SIZE < start + len(fed):
                job.blocks.append(self.free_blocks.pop())
            plan.seq_ids.append(job.seq_id)
            plan.start_positions.append(start)
            plan.sample.append(samples)
            plan.token_ids.extend(fed)
            plan.token_offsets.append(len(plan.token_ids))
            plan.block_ids.extend(job.blocks[job.num_blocks_sent :])
            plan.block_offsets.append(len(plan.block_ids))
            job.num_blocks_sent = len(job.blocks)
            job.num_fed += len(fed)
            job.num_sampling += samples
        self.num_plans += 1
        return plan

    def _more(self) -> bool:
        return any(job.num_sampling < self.num_new_tokens for job in self.jobs)

    def read(self, launched) -> None:
        result = self.engine.read(launched)
        # Read, a step keeps no step before it alive (nor its own device tensors).
        assert launched.after is None and launched.tokens is None
        self.results.append(result)
        assert not result.step_error, result.step_error
        assert not result.errors, result.errors
        jobs = {job.seq_id: job for job in self.jobs}
        for k, seq_id in enumerate(result.seq_ids):
            jobs[seq_id].generated.append(result.token_ids[k])
            if result.logprobs:
                jobs[seq_id].logprobs.append(result.logprobs[k])

    def run(self) -> dict[int, list[int]]:
        engine = self.engine
        launched = engine.launch(self.plan())
        while launched is not None:
            following, waiting = None, None
            if self.ahead and self._more():
                plan = self.plan()
                if engine.can_launch_ahead(plan):
                    following = engine.launch(plan)
                    self.num_launched_ahead += 1
                else:
                    waiting = plan  # launched once `launched` is read, as the server does
            self.read(launched)
            if waiting is not None:
                following = engine.launch(waiting)
            elif following is None and self._more():
                following = engine.launch(self.plan())
            launched = following
        return {job.seq_id: job.generated for job in self.jobs}


def staggered(driver: Driver, prompts, sampling=None) -> Driver:
    for seq_id, prompt in enumerate(prompts):
        chunks = [3, 5] if seq_id % 2 else []  # chunked prefill beside decodes
        driver.add(seq_id, prompt, sampling and sampling(seq_id), chunks, admit_at=seq_id)
    return driver


def run_both(make_engine, prompts, num_new_tokens=10, sampling=None):
    serial = staggered(
        Driver(make_engine(), ahead=False, num_new_tokens=num_new_tokens), prompts, sampling
    )
    ahead = staggered(
        Driver(make_engine(), ahead=True, num_new_tokens=num_new_tokens), prompts, sampling
    )
    return serial, serial.run(), ahead, ahead.run()


def test_greedy_tokens_launched_ahead_are_the_serial_ones_and_generates(llama_models):
    prompts = random_prompts(5, seed=31)
    serial, tokens_serial, ahead, tokens_ahead = run_both(llama_models.engine, prompts)
    assert tokens_ahead == tokens_serial
    assert tokens_ahead == {i: llama_models.greedy(p, 10) for i, p in enumerate(prompts)}
    assert ahead.num_launched_ahead >= 10  # every step after the first, but the last
    # Mixed steps (a prompt chunk beside placeholder rows) ran the packed path.
    assert any(len(r.token_ids) for r in ahead.results)


def test_histories_hold_the_tokens_once_read(llama_models):
    prompts = random_prompts(3, seed=32)
    engine = llama_models.engine()
    driver = staggered(Driver(engine, ahead=True, num_new_tokens=6, forget=False), prompts)
    driver.run()
    for job in driver.jobs:
        history = engine.table.get(job.seq_id).token_ids
        assert PENDING_TOKEN not in history
        assert history == job.prompt + job.generated[:-1]  # the last one was never fed


def test_seeded_sampling_and_logprobs_launched_ahead_are_the_serial_ones(llama_models):
    def sampling(seq_id):
        return SamplingParams(
            temperature=0.9, top_k=40, top_p=0.95, seed=seq_id + 7, num_logprobs=2
        )

    prompts = random_prompts(4, seed=33)
    serial, tokens_serial, ahead, tokens_ahead = run_both(llama_models.engine, prompts, 8, sampling)
    assert tokens_ahead == tokens_serial
    assert [j.logprobs for j in ahead.jobs] == [j.logprobs for j in serial.jobs]
    assert ahead.num_launched_ahead > 0


def test_padded_graph_steps_launched_ahead_are_the_serial_ones(llama_models):
    """The decode graphs' static buffers, filled on the device from the unread step (run
    eagerly here: no capture on a CPU), with both pinned staging sets in turn."""
    from pagoda.gpu_worker.cuda_graphs import DecodeGraphs, is_decode_only

    def graphed_engine():
        engine = llama_models.engine(num_kv_blocks=TEST_NUM_BLOCKS + 1)
        graphs = DecodeGraphs(engine, scratch_block=TEST_NUM_BLOCKS, buckets=(1, 2, 4, 8))
        graphs.fits = is_decode_only
        engine.decode_graphs = graphs
        return engine

    prompts = random_prompts(5, seed=34)
    serial, tokens_serial, ahead, tokens_ahead = run_both(graphed_engine, prompts, 12)
    assert (
        tokens_ahead
        == tokens_serial
        == {i: llama_models.greedy(p, 12) for i, p in enumerate(prompts)}
    )
    assert ahead.engine.decode_graphs._num_staged > 2


def test_piecewise_steps_launched_ahead_are_the_serial_ones(llama_models):
    """Mixed steps through the piecewise graphs' padded forward (eager here): the
    placeholder rows are filled in the packed batch before it is staged."""
    from pagoda.gpu_worker.piecewise_graphs import PiecewiseGraphs

    def piecewise_engine():
        engine = llama_models.engine()
        graphs = PiecewiseGraphs(engine, (16, 32, 64, 128))
        graphs.fits = lambda batch: graphs.bucket_for(batch.num_tokens) is not None
        graphs.run = graphs.run_eager
        engine.piecewise_graphs = graphs
        return engine

    prompts = random_prompts(5, seed=36)
    serial, tokens_serial, ahead, tokens_ahead = run_both(piecewise_engine, prompts)
    assert (
        tokens_ahead
        == tokens_serial
        == {i: llama_models.greedy(p, 10) for i, p in enumerate(prompts)}
    )
    assert ahead.num_launched_ahead >= 10
    assert ahead.engine.piecewise_graphs.layers  # the cut ran


def test_a_failed_read_fails_the_step_launched_ahead_of_it(llama_models):
    engine = llama_models.engine()
    driver = Driver(engine, ahead=True, num_new_tokens=8)
    for seq_id, prompt in enumerate(random_prompts(2, seed=35)):
        driver.add(seq_id, prompt)
    first = engine.launch(driver.plan())
    driver.read(first)
    second = engine.launch(driver.plan())
    third = engine.launch(driver.plan())  # ahead of the second
    assert third.after is second

    class DeviceError:
        def done(self):
            return True

        def read(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    second.tokens = DeviceError()
    failed = engine.read(second)
    assert "illegal memory access" in failed.step_error
    then = engine.read(third)
    assert f"step {second.plan.step_id}, launched before it, failed" in then.step_error
    assert len(engine.table) == 0  # both steps named both sequences: all forgotten


def test_a_refused_row_launched_ahead_is_refused_alone(llama_models):
    engine = llama_models.engine()
    driver = Driver(engine, ahead=True, num_new_tokens=8)
    for seq_id, prompt in enumerate(random_prompts(2, seed=36)):
        driver.add(seq_id, prompt)
    driver.read(engine.launch(driver.plan()))
    second = engine.launch(driver.plan())
    plan = driver.plan()
    plan.start_positions[1] += 1  # seq 1's placeholder is fed at the wrong position
    third = engine.launch(plan)
    assert not engine.read(second).errors
    result = engine.read(third)
    assert list(result.errors) == [1] and "belongs at" in result.errors[1]
    assert result.seq_ids == [0] and 1 not in engine.table
    # Seq 0's token was fed from the device and its history patched in by the read.
    assert PENDING_TOKEN not in engine.table.get(0).token_ids


def test_what_may_not_be_launched_ahead(llama_models):
    engine = llama_models.engine()
    driver = Driver(engine, ahead=True, num_new_tokens=8)
    driver.add(0, [5, 6, 7])
    driver.add(1, [8, 9], SamplingParams(repetition_penalty=1.3))
    driver.read(engine.launch(driver.plan()))
    engine.launch(driver.plan())
    plan = driver.plan()  # both rows are placeholders now
    assert plan.last_sampled_rows == [0, 1]
    assert engine.can_launch_ahead(plan)  # a penalty is counted on the device too
    plan.masks_follow = True  # its masks come once the step before is answered
    assert not engine.can_launch_ahead(plan)
    plan.masks_follow = False
    engine.fail_on_token_id = 3
    assert not engine.can_launch_ahead(plan)
    engine.fail_on_token_id = None
    engine.launches_ahead = False  # --launch-ahead off (or auto on a CPU)
    assert not engine.can_launch_ahead(plan)


def test_penalized_rows_launched_ahead_give_the_serial_tokens_and_counts(llama_models):
    """Repetition, presence and frequency penalties read counts that a row launched ahead
    takes from the unread step's tokens on the device (TokenCounts.update's fill)."""
    from pagoda.gpu_worker.sampler import SampleRow, counts_from_histories

    def sampling(seq_id):
        if seq_id == 1:
            return SamplingParams(repetition_penalty=1.5)
        if seq_id == 2:
            return SamplingParams(presence_penalty=0.8, frequency_penalty=0.6)
        return SamplingParams()

    prompts = random_prompts(3, seed=37)
    serial, tokens_serial, ahead, tokens_ahead = run_both(
        llama_models.engine, prompts, 10, sampling
    )
    assert tokens_ahead == tokens_serial
    assert tokens_serial[1] != llama_models.greedy(prompts[1], 10)  # the penalty bites
    assert ahead.num_launched_ahead == ahead.num_plans - 1  # every step after the first
    engine = llama_models.engine()
    driver = staggered(Driver(engine, ahead=True, num_new_tokens=10, forget=False), prompts)
    for job in driver.jobs:
        job.sampling = sampling(job.seq_id)
    driver.run()
    counts = engine.token_counts
    for job in driver.jobs[1:]:
        seq = engine.table.get(job.seq_id)
        position = len(seq.token_ids)
        row = SampleRow(seq.sampling, seq.token_ids, seq.num_prompt_tokens, position)
        want_seen, want_generated = counts_from_histories([row], counts.vocab_size, "cpu")
        seen, generated = counts.gather([counts.row_of(seq)])
        assert torch.equal(seen, want_seen) and torch.equal(generated, want_generated)
