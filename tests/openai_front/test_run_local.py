"""`make run` (scripts/run_local.py) starts pagoda-openai beside the service, prints its URL,
and the curl request it prints (no model named) works; Ctrl-C stops all three."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from pagoda.client import Client
from tests.e2e.conftest import REPO_ROOT, free_port

pytestmark = pytest.mark.slow


def test_run_local_starts_the_front_and_prints_its_url():
    grpc_address = f"127.0.0.1:{free_port()}"
    openai_address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [sys.executable, "scripts/run_local.py", "--model", "dummy", "--grpc-address",
         grpc_address, "--openai-address", openai_address],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
    )  # fmt: skip
    try:
        seen = []
        for line in process.stdout:  # ends when the script exits; the timeout bounds it
            seen.append(line)
            if "Ctrl-C stops them all" in line:
                break
        banner = "".join(seen)
        url = f"http://{openai_address}/v1"
        assert f"OpenAI-compatible API: {url}" in banner, banner[-3000:]
        assert f"curl -s {url}/chat/completions" in banner
        response = httpx.post(
            f"{url}/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Write a haiku about the sea"}],
                "max_tokens": 4,
            },
            timeout=60,
        )
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["role"] == "assistant"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_run_local_puts_replicas_behind_the_router():
    """--replicas 2: two workers and schedulers behind pagoda-router on --grpc-address; the
    router's GetServerStats counts both workers, and a request is served through it."""
    grpc_address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [sys.executable, "scripts/run_local.py", "--model", "dummy", "--grpc-address",
         grpc_address, "--openai-address", "none", "--replicas", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
    )  # fmt: skip
    try:
        seen = []
        for line in process.stdout:
            seen.append(line)
            if "Ctrl-C stops them all" in line:
                break
        assert "pagoda-router pid" in "".join(seen), "".join(seen)[-3000:]
        with Client(grpc_address) as client:
            assert len(client.server_stats().workers) == 2
            assert client.complete([5, 6, 7], max_new_tokens=3, ignore_eos=True).usage
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
