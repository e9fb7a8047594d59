"""A tcp:// worker link without CurveZMQ is refused at start by both processes unless
--zmq-allow-insecure-tcp (or its environment variable or TOML key) says so."""

from __future__ import annotations

import logging

import pytest

from pagoda.gpu_worker.config import parse_config
from pagoda.scheduler_svc import settings
from pagoda.scheduler_svc.core.config import ConfigError
from pagoda.scheduler_svc.worker_link import WorkerLink

TCP = "tcp://127.0.0.1:5557"


def test_the_scheduler_refuses_plaintext_tcp():
    with pytest.raises(ConfigError, match="--zmq-allow-insecure-tcp"):
        settings.load(["--zmq-endpoint", TCP], {})


@pytest.mark.parametrize(
    ("argv", "environ", "toml"),
    [
        (["--zmq-allow-insecure-tcp"], {}, ""),
        ([], {"PAGODA_ZMQ_ALLOW_INSECURE_TCP": "true"}, ""),
        ([], {}, "zmq_allow_insecure_tcp = true\n"),
    ],
)
def test_the_scheduler_takes_plaintext_tcp_when_told(tmp_path, argv, environ, toml):
    if toml:
        path = tmp_path / "pagoda.toml"
        path.write_text(toml)
        argv = [*argv, "--config", str(path)]
    loaded, _ = settings.load(["--zmq-endpoint", TCP, *argv], environ)
    assert loaded.config.zmq_allow_insecure_tcp is True


def test_ipc_and_curve_need_no_flag(tmp_path):
    settings.load(["--zmq-endpoint", f"ipc://{tmp_path}/w.sock"], {})
    curve = ["--zmq-curve-secret-key", "s", "--zmq-curve-authorized-keys", str(tmp_path)]
    settings.load(["--zmq-endpoint", TCP, *curve], {})


def test_the_worker_refuses_plaintext_tcp(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_config(["--zmq-endpoint", TCP], {})
    assert exited.value.code == 2
    assert "--zmq-allow-insecure-tcp" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "environ", "toml"),
    [
        (["--zmq-allow-insecure-tcp"], {}, ""),
        ([], {"PAGODA_WORKER_ZMQ_ALLOW_INSECURE_TCP": "1"}, ""),
        ([], {}, "zmq_allow_insecure_tcp = true\n"),
    ],
)
def test_the_worker_takes_plaintext_tcp_when_told(tmp_path, argv, environ, toml):
    if toml:
        path = tmp_path / "worker.toml"
        path.write_text(toml)
        argv = [*argv, "--config", str(path)]
    config = parse_config(["--zmq-endpoint", TCP, *argv], environ)
    assert config.zmq_allow_insecure_tcp is True
    curve = ["--zmq-curve-secret-key", "s", "--zmq-curve-server-key", "p"]
    assert parse_config(["--zmq-endpoint", TCP, *curve], {}).zmq_allow_insecure_tcp is False


def test_an_allowed_plaintext_link_logs_a_warning(caplog):
    import asyncio

    class Events:
        def worker_attached(self, info) -> None: ...

        def worker_detached(self, reason: str, *, suspect: bool = True) -> None: ...

    async def scenario() -> None:
        link = WorkerLink("tcp://127.0.0.1:0")
        await link.start(Events())
        await link.close()

    with caplog.at_level(logging.WARNING, logger="pagoda.worker_link"):
        asyncio.run(scenario())
    assert any("without CurveZMQ" in r.getMessage() for r in caplog.records)
