"""pagoda-openai's settings: flags > PAGODA_OPENAI_* > TOML > defaults, validated."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda.common.settings import split_host_port
from pagoda.openai_front.config import FrontConfig, describe, load_config


def test_defaults_listen_on_loopback_and_target_the_local_scheduler():
    config = load_config([], environ={}).config
    assert (config.listen, config.target) == ("127.0.0.1:8000", "127.0.0.1:50051")
    assert config.tls_root_cert is None


def test_flags_beat_environment_beat_toml(tmp_path):
    toml = tmp_path / "front.toml"
    toml.write_text('listen = "127.0.0.1:9001"\ntarget = "10.0.0.1:1"\nmax_n = 4\n')
    environ = {"PAGODA_OPENAI_CONFIG": str(toml), "PAGODA_OPENAI_TARGET": "10.0.0.2:2"}
    loaded = load_config(["--max-n", "8"], environ=environ)
    assert loaded.config.listen == "127.0.0.1:9001"
    assert loaded.config.target == "10.0.0.2:2"
    assert loaded.config.max_n == 8
    assert loaded.sources["listen"] == f"toml {toml}"
    assert loaded.sources["target"] == "env PAGODA_OPENAI_TARGET"
    assert loaded.sources["max_n"] == "flag"
    assert 'target = "10.0.0.2:2"' in describe(loaded)


def test_the_schedulers_environment_is_not_read():
    config = load_config([], environ={"PAGODA_LOG_LEVEL": "DEBUG"}).config
    assert config.log_level == "INFO"


@pytest.mark.parametrize(
    "argv",
    [["--listen", "8000"], ["--target", "host"], ["--tls-cert", "c.pem"], ["--max-n", "0"],
     ["--log-format", "xml"]],
)  # fmt: skip
def test_bad_settings_exit_2(argv):
    with pytest.raises(SystemExit) as caught:
        load_config(argv, environ={})
    assert caught.value.code == 2


def test_log_format_from_the_environment_is_checked(capsys):
    assert load_config([], environ={"PAGODA_OPENAI_LOG_FORMAT": "JSON"}).config.log_format == "json"
    with pytest.raises(SystemExit):
        load_config([], environ={"PAGODA_OPENAI_LOG_FORMAT": "xml"})
    assert "--log-format must be one of text, json" in capsys.readouterr().err


def test_unknown_toml_key_exits_2(tmp_path):
    toml = tmp_path / "front.toml"
    toml.write_text("no_such_key = 1\n")
    with pytest.raises(SystemExit):
        load_config(["--config", str(toml)], environ={})


def test_ipv6_listen_address():
    assert split_host_port("[::1]:8000") == ("::1", 8000)
    assert FrontConfig(listen="[::1]:8001").listen_host == "::1"


def test_print_config_runs_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.openai_front", "--print-config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert 'listen = "127.0.0.1:8000"' in result.stdout
