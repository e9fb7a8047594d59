"""A live stack for the front: scheduler + dummy worker (tests/e2e) and pagoda-openai as a
subprocess on a free loopback port, ready once its /health says the scheduler serves; and
the front in this process, in front of the client tests' fake gRPC server."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagoda.openai_front.app import build_app
from pagoda.openai_front.config import FrontConfig
from pagoda.openai_front.upstream import Upstream
from pagoda.protos import generation_pb2
from tests.client.fake_server import FakeGenerationServicer, FakeServer
from tests.e2e.conftest import (
    READY_TIMEOUT_S,
    REPO_ROOT,
    Service,
    free_port,
    running_service,
    stop_process,
    wait_until,
)

API_KEY = "front-test-key"
METADATA = (("authorization", f"Bearer {API_KEY}"),)
# Slow enough that a stream is still running when its client goes away, quick enough for
# the short generations of the other tests.
DUMMY_STEP_MS = 20


@dataclass
class Front:
    url: str
    process: subprocess.Popen
    service: Service
    log_path: Path

    def stats(self) -> generation_pb2.ServerStats:
        with self.service.channel() as channel:
            return self.service.stub(channel).GetServerStats(
                generation_pb2.ServerStatsRequest(), timeout=10, metadata=METADATA
            )

    def client(self, api_key: str | None = API_KEY, **kwargs) -> httpx.Client:
        headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        kwargs.setdefault("timeout", 60)
        return httpx.Client(base_url=self.url, headers=headers, **kwargs)


def start_front(
    target: str,
    log_path: Path,
    *args: str,
    serving: bool = True,
    scheme: str = "http",
    verify: ssl.SSLContext | bool = True,
) -> tuple[subprocess.Popen, str]:
    """pagoda-openai for `target` on a free port; returns once /health answers (200 when
    `serving`, else any answer: a front whose scheduler is away still listens). `verify`:
    the CA file an https front is checked against."""
    address = f"127.0.0.1:{free_port()}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "pagoda.openai_front", "--listen", address,
             "--target", target, *args],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
        )  # fmt: skip
    url = f"{scheme}://{address}"

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"pagoda-openai exited with {process.returncode}")
        try:
            status = httpx.get(f"{url}/health", timeout=1, verify=verify).status_code
        except httpx.HTTPError:
            return False
        return status == 200 or not serving

    wait_until(ready, READY_TIMEOUT_S, f"pagoda-openai on {url} to answer")
    return process, url


@contextmanager
def sdk_stack(model_dir: Path, tmp_path: Path) -> Iterator[tuple[Service, openai.OpenAI, str]]:
    """A scheduler and worker serving `model_dir` and a front before them: the service, the
    official client on the front and the served model's id."""
    with running_service(tmp_path, model=str(model_dir)) as service:
        process, url = start_front(service.address, tmp_path / "openai-front.log")
        try:
            sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0)
            yield service, sdk, sdk.models.list().data[0].id
        finally:
            stop_process(process)


@pytest.fixture(scope="module")
def front(tmp_path_factory) -> Iterator[Front]:
    tmp_path = tmp_path_factory.mktemp("openai-front")
    key_file = tmp_path / "api.key"
    key_file.write_text(f"{API_KEY}\n")
    with running_service(
        tmp_path,
        model="dummy",
        worker_args=["--dummy-step-ms", str(DUMMY_STEP_MS)],
        scheduler_args=["--api-key-file", str(key_file)],
    ) as service:
        log_path = tmp_path / "openai-front.log"
        process, url = start_front(service.address, log_path)
        try:
            yield Front(url, process, service, log_path)
        except BaseException:
            print(log_path.read_text()[-4000:])
            raise
        finally:
            stop_process(process)


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    with FakeServer(FakeGenerationServicer()) as server:
        yield server


@asynccontextmanager
async def front_app(target: str) -> AsyncIterator[Any]:
    """The front's ASGI app for `target`, its upstream open (as its lifespan would)."""
    upstream = Upstream(target, None)
    upstream.open()
    try:
        yield build_app(FrontConfig(), upstream)
    finally:
        await upstream.close()


def with_front(fake_server: FakeServer, scenario) -> object:
    """Run `scenario(sdk, http)` against the front's ASGI app in this process."""

    async def main() -> object:
        async with front_app(fake_server.target) as app:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://front") as http:
                sdk = openai.AsyncOpenAI(
                    base_url="http://front/v1", api_key="k", http_client=http, max_retries=0
                )
                return await scenario(sdk, http)

    return asyncio.run(asyncio.wait_for(main(), timeout=30))
