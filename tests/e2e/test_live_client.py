"""The Python clients and the `pagoda` CLI against a live service on the default model, and a
worker SIGKILLed under real greedy streams."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from pagoda.client.async_client import AsyncClient
from pagoda.client.sync_client import Client
from tests.e2e.conftest import REPO_ROOT, running_service, wait_until

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
EXACT = ["--quantization", "none"]  # the float weights transformers runs
PROMPTS = [
    "The sea is",
    "Write a short story about a robot who learns to paint. Once upon a time,",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    # The reference is transformers' float forward: pin the float weights.
    with running_service(
        tmp_path_factory.mktemp("live"), model="default", worker_args=EXACT
    ) as service:
        yield service


def pagoda(service, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagoda.client", "--target", service.address, *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )


def test_sync_and_async_clients_stream_the_reference_tokens(service, default_reference):
    prompt_ids = default_reference.tokenizer.encode(PROMPTS[1])
    expected = default_reference(prompt_ids, 20)
    with Client(service.address, timeout_s=120) as client:
        completion = client.complete(PROMPTS[1], max_new_tokens=20, ignore_eos=True)
        answer = "".join(chunk.text for chunk in client.chat([("user", QUESTION)]))
        info = client.model_info()

    async def asynchronous():
        async with AsyncClient(service.address, timeout_s=120) as client:
            return await client.complete(prompt_ids, max_new_tokens=20, ignore_eos=True)

    async_completion = asyncio.run(asynchronous())
    assert completion.token_ids == expected
    assert async_completion.token_ids == expected
    assert completion.text == default_reference.tokenizer.decode(expected)
    assert completion.usage.prompt_tokens == len(prompt_ids)
    assert "Paris" in answer
    assert info.has_chat_template and info.worker_connected and info.num_kv_blocks > 0
    assert info.quantization == "none"


def test_cli_generate_answers_as_the_model_was_tuned_and_raw_continues(service):
    answered = pagoda(service, "generate", QUESTION, "--max-new-tokens", "24")
    assert answered.returncode == 0, answered.stderr
    assert "Paris" in answered.stdout
    raw = pagoda(service, "generate", "1, 2, 3, 4,", "--raw", "--max-new-tokens", "6")
    assert raw.returncode == 0, raw.stderr
    assert raw.stdout.lstrip().startswith("5")


def test_cli_info_stats_and_errors(service):
    info = pagoda(service, "info", "--json")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    stats = pagoda(service, "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["worker_connected"] is True
    refused = pagoda(service, "generate", "hi", "--top-p", "1.5")
    assert refused.returncode == 1
    assert refused.stderr.startswith("pagoda: INVALID_ARGUMENT:") and "top_p" in refused.stderr


def test_worker_sigkilled_under_greedy_streams_resumes_with_the_reference_tokens(
    tmp_path, default_reference
):
    """Recompute after a worker loss on real weights: every stream equals an uninterrupted
    run, with nothing lost or repeated across the pause."""
    num_new_tokens = 96
    prompts_ids = [default_reference.tokenizer.encode(p) for p in PROMPTS]
    expected = [default_reference(ids, num_new_tokens) for ids in prompts_ids]
    with running_service(tmp_path, model="default", worker_args=EXACT) as service:

        async def scenario():
            async with AsyncClient(service.address, timeout_s=540) as client:
                tasks = [
                    asyncio.create_task(
                        client.complete(ids, max_new_tokens=num_new_tokens, ignore_eos=True)
                    )
                    for ids in prompts_ids
                ]
                before = await asyncio.to_thread(
                    wait_until,
                    lambda: (s := service.stats()).num_generated_tokens > 24 and s,
                    120,
                    "tokens to flow",
                )
                await asyncio.to_thread(service.replace_worker)
                return before, await asyncio.gather(*tasks)

        before, completions = asyncio.run(scenario())
        assert before.num_requests_finished == 0  # the kill landed mid-flight
        for completion, reference in zip(completions, expected, strict=True):
            assert completion.finish_reason == "length"
            assert completion.token_ids == reference
