"""TLS on both sides of the front: gRPC TLS to a scheduler that has a certificate
(--tls-root-cert), and HTTPS for its own clients (--tls-cert/--tls-key)."""

from __future__ import annotations

import shutil
import ssl

import openai
import pytest

from tests.conftest import self_signed_certificate
from tests.e2e.conftest import running_service, stop_process
from tests.openai_front.conftest import start_front

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


def test_front_speaks_tls_to_the_scheduler_and_https_to_its_clients(tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    with running_service(
        tmp_path, model="dummy", scheduler_args=tls, plaintext_health=False
    ) as service:
        process, url = start_front(
            service.address,
            tmp_path / "front.log",
            "--tls-root-cert", str(cert), *tls,
            scheme="https",
            verify=ssl.create_default_context(cafile=str(cert)),
        )  # fmt: skip
        try:
            context = ssl.create_default_context(cafile=str(cert))
            sdk = openai.OpenAI(
                base_url=f"{url}/v1",
                api_key="EMPTY",
                max_retries=0,
                http_client=openai.DefaultHttpxClient(verify=context),
            )
            completion = sdk.completions.create(
                model=sdk.models.list().data[0].id, prompt="Hi", max_tokens=3,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert completion.usage.completion_tokens == 3
            # An idle keep-alive TLS connection would hold the front's shutdown until its
            # drain timeout (asyncio waits for the peer's close_notify): hang up first.
            sdk.close()
        finally:
            stop_process(process)
