"""A tensor-parallel worker (--tensor-parallel-size N, ranks spawned by the worker itself,
gloo on the CPU) behind a real scheduler: greedy output equals transformers' generate()
of the unsharded model, and a rank that dies takes the worker down with a non-zero exit.

Reduction order: each row-parallel layer sums the ranks' partial products, which rounds
differently from one process's single matmul (float32, ~1e-7 relative); greedy tokens
match unless a step's two best logits fall within that rounding (see
pagoda.gpu_worker.tensor_parallel). The prompts here are fixed, so a pass is repeatable.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from pagoda.gpu_worker.server import EXIT_GROUP_LOST
from tests.e2e.conftest import (
    Service,
    _spawn,
    free_port,
    running_service,
    stop_process,
    wait_serving,
    wait_until,
)
from tests.e2e.test_generation import EXACT, MIXED_PROMPTS, NUM_NEW_TOKENS, concurrent_greedy

pytestmark = pytest.mark.slow

TINY_PROMPTS = [[5 + i, 40 + 3 * i, 7, 300 - i, 11 * i + 1, 99][: 3 + i % 4] for i in range(4)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tiny_model_factory) -> tuple[Path, object]:
    """The tiny llama (GQA: 4 heads over 2 KV heads) with weights that make each token
    depend on its context (tests.worker.conftest.diversify), saved with its tokenizer."""
    import transformers

    from tests.worker.conftest import diversify

    source = tiny_model_factory("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    diversify(model)
    directory = tmp_path_factory.mktemp("tiny-llama-diverse")
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, directory / name)
    return directory, model


def generate(model, prompt_ids: list[int], num_new_tokens: int) -> list[int]:
    import torch

    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=num_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return output[0, len(prompt_ids) :].tolist()


def spawned_ranks(worker_pid: int) -> list[int]:
    """The worker's rank processes (torch.multiprocessing's spawn children), not its
    resource tracker."""
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    return [
        int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def test_two_ranks_serve_the_tiny_model_like_generate(tmp_path, tiny_model):
    directory, model = tiny_model
    expected = [generate(model, ids, NUM_NEW_TOKENS) for ids in TINY_PROMPTS]
    with running_service(
        tmp_path, model=str(directory), worker_args=[*EXACT, "--tensor-parallel-size", "2"]
    ) as service:
        assert len(spawned_ranks(service.worker.pid)) == 1
        assert concurrent_greedy(service, TINY_PROMPTS) == expected
        assert service.stats().num_kv_blocks_used == 0


def test_a_dead_rank_takes_the_worker_down_with_a_restartable_exit(tmp_path, tiny_model):
    directory, _ = tiny_model
    with running_service(
        tmp_path, model=str(directory), worker_args=[*EXACT, "--tensor-parallel-size", "2"]
    ) as service:
        (rank_1,) = spawned_ranks(service.worker.pid)
        os.kill(rank_1, signal.SIGKILL)
        # Not 2 (refused, which systemd does not restart): the group was lost.
        assert service.worker.wait(timeout=60) == EXIT_GROUP_LOST
        wait_until(
            lambda: not service.stats().worker_connected, 30, "the scheduler to see the loss"
        )


def test_torchrun_ranks_join_and_serve_like_generate(tmp_path, tiny_model):
    """Ranks started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK)
    instead of spawned by the worker."""
    directory, model = tiny_model
    expected = [generate(model, ids, NUM_NEW_TOKENS) for ids in TINY_PROMPTS[:2]]
    run_dir = Path(tempfile.mkdtemp(prefix="pagoda-torchrun-", dir="/tmp"))
    endpoint = f"ipc://{run_dir}/worker.sock"
    service = Service(
        address=f"127.0.0.1:{free_port()}",
        endpoint=endpoint,
        worker=None,
        scheduler=None,
        log_dir=tmp_path,
        worker_args=[],
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    try:
        service.scheduler = _spawn(
            [
                sys.executable, "-m", "pagoda.scheduler_svc", "--grpc-address", service.address,
                "--zmq-endpoint", endpoint, "--model", str(directory),
            ],
            tmp_path / "scheduler.log",
        )  # fmt: skip
        service.worker = _spawn(
            [
                *torchrun, *rendezvous, "-m", "pagoda.gpu_worker", "--zmq-endpoint", endpoint,
                "--model", str(directory), *EXACT, "--tensor-parallel-size", "2",
            ],
            tmp_path / "worker.log",
        )  # fmt: skip
        wait_serving(service.address, [service.scheduler, service.worker])
        assert concurrent_greedy(service, TINY_PROMPTS[:2]) == expected
    except BaseException:
        print(service.logs())
        raise
    finally:
        stop_process(service.worker)  # torchrun passes SIGTERM on to both ranks
        stop_process(service.scheduler)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_three_ranks_serve_the_default_model_like_generate(tmp_path, default_reference):
    """SmolLM2-135M has 9 heads over 3 KV heads: 3 ranks (2 would split a head)."""
    tokenizer = default_reference.tokenizer
    prompts_ids = [tokenizer.encode(p) for p in MIXED_PROMPTS[:3]]
    expected = [default_reference(ids, NUM_NEW_TOKENS) for ids in prompts_ids]
    with running_service(
        tmp_path,
        model="default",
        worker_args=[*EXACT, "--tensor-parallel-size", "3"],
        # Three ranks on two shared cores: a step may take longer than the default 30 s.
        scheduler_args=["--worker-timeout-s", "600"],
    ) as service:
        assert len(spawned_ranks(service.worker.pid)) == 2
        assert concurrent_greedy(service, prompts_ids) == expected
