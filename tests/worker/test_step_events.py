"""A step waits for its device once, on an event after the sampled tokens' copy, never with
torch.cuda.synchronize (gpu_worker/step_events.py). On the CPU the same code runs with
events that do nothing: the steps' results are those of generate(), and the waits are
counted."""

from __future__ import annotations

import torch

from pagoda.gpu_worker import step_events
from tests.worker.conftest import TEST_BLOCK_SIZE, TEST_NUM_BLOCKS, random_prompts
from tests.worker.toy_scheduler import ToyScheduler


def count_waits(monkeypatch) -> list[str]:
    """Every DeviceEvent.synchronize, named by the step_events function that waited."""
    waits: list[str] = []
    real = step_events.DeviceEvent.synchronize

    def counted(self):
        waits.append("wait")
        return real(self)

    def no_device_wide_sync(*args, **kwargs):
        raise AssertionError("a step called torch.cuda.synchronize")

    monkeypatch.setattr(step_events.DeviceEvent, "synchronize", counted)
    monkeypatch.setattr(torch.cuda, "synchronize", no_device_wide_sync)
    return waits


def test_each_step_waits_once_and_matches_generate(llama_models, monkeypatch):
    waits = count_waits(monkeypatch)
    engine = llama_models.engine()
    scheduler = ToyScheduler(engine, num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE)
    prompts = random_prompts(4, seed=21)
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, prompt)
    num_steps = 0
    real_step = engine.step

    def counting_step(plan):
        nonlocal num_steps
        num_steps += 1
        result = real_step(plan)
        assert result.forward_ms >= 0 and result.sample_ms >= 0
        return result

    engine.step = counting_step
    got = scheduler.run(6)
    assert got == {i: llama_models.greedy(p, 6) for i, p in enumerate(prompts)}
    assert num_steps > 0 and len(waits) == num_steps


def test_a_step_that_samples_nothing_still_waits(llama_models, monkeypatch):
    """A chunk inside a prompt samples nothing; the step still ends with one wait, as the
    next one reuses pinned staging buffers."""
    waits = count_waits(monkeypatch)
    engine = llama_models.engine()
    scheduler = ToyScheduler(engine, num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE)
    (prompt,) = random_prompts(1, seed=22, min_len=30, max_len=30)
    scheduler.add(0, prompt, chunk_sizes=[10, 10, 10])
    result = scheduler.step(lambda job: len(job.known) >= len(prompt) + 1)
    assert list(result.token_ids) == [] and len(waits) == 1


def test_host_copy_and_clock_on_cpu():
    tensor = torch.arange(5)
    copy = step_events.HostCopy(tensor)
    assert copy.done() and copy.read() is tensor
    clock = step_events.StepClock(torch.device("cpu"))
    clock.forward_enqueued()
    forward_ms, sample_ms = clock.timings_ms()
    assert forward_ms >= 0 and sample_ms >= 0
