"""Flags > PAGODA_WORKER_* environment > TOML file > defaults, validated once."""

from __future__ import annotations

import pytest

from pagoda.gpu_worker.config import (
    WorkerConfig,
    default_zmq_endpoint,
    describe,
    load_config,
    parse_config,
)


def test_defaults():
    config = parse_config([], environ={"XDG_RUNTIME_DIR": "/run/user/7"})
    assert config == WorkerConfig(zmq_endpoint="ipc:///run/user/7/pagoda/worker.sock")
    assert config.block_size == 16 and config.num_kv_blocks is None
    assert config.model == "default" and config.device == "auto" and config.log_level == "INFO"
    assert config.log_format == "text"


def test_default_endpoint_without_a_runtime_dir_is_per_user():
    assert default_zmq_endpoint({}).startswith("ipc:///tmp/pagoda-")


def test_environment_fills_in_and_flags_win():
    environ = {
        "PAGODA_WORKER_BLOCK_SIZE": "32",
        "PAGODA_WORKER_MODEL": "dummy",
        "PAGODA_WORKER_NUM_KV_BLOCKS": "100",
        "PAGODA_WORKER_LOG_LEVEL": "debug",
        "PAGODA_WORKER_LOG_FORMAT": "JSON",
    }
    config = parse_config(
        ["--block-size", "8", "--zmq-endpoint", "tcp://127.0.0.1:5555", "--zmq-allow-insecure-tcp"],
        environ,
    )
    assert config.block_size == 8
    assert config.model == "dummy" and config.is_dummy
    assert config.num_kv_blocks == 100
    assert config.log_level == "DEBUG" and config.log_format == "json"
    assert config.zmq_endpoint == "tcp://127.0.0.1:5555"


def test_the_two_kinds_of_graph_turn_off_apart():
    """--no-piecewise-graphs keeps the decode graphs (PagedEngine builds the pieces only
    beside them, so --no-cuda-graphs turns both off)."""
    assert parse_config([], {}).piecewise_graphs and parse_config([], {}).cuda_graphs
    config = parse_config(["--no-piecewise-graphs"], {})
    assert config.cuda_graphs and not config.piecewise_graphs
    config = parse_config([], {"PAGODA_WORKER_PIECEWISE_GRAPHS": "false"})
    assert not config.piecewise_graphs


@pytest.mark.parametrize(
    ("argv", "environ"),
    [
        (["--block-size", "0"], {}),
        (["--gpu-memory-utilization", "1.5"], {}),
        (["--zmq-endpoint", "no-scheme"], {}),
        ([], {"PAGODA_WORKER_BLOCK_SIZE": "sixteen"}),
        ([], {"PAGODA_WORKER_DEVICE": "tpu"}),
        ([], {"PAGODA_WORKER_LOG_FORMAT": "xml"}),
        (["--log-format", "xml"], {}),
        (["--model", "some/model", "--dummy-crash-on-token-id", "5"], {}),
    ],
)
def test_bad_values_exit_with_a_message(argv, environ, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_config(argv, environ)
    assert exited.value.code == 2
    assert "error" in capsys.readouterr().err


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--help"], {})
    text = capsys.readouterr().out
    for flag in [
        "--zmq-endpoint",
        "--model",
        "--device",
        "--dtype",
        "--block-size",
        "--kv-cache-gib",
        "--gpu-memory-utilization",
        "--num-kv-blocks",
        "--max-context-tokens",
        "--log-level",
        "--log-format",
        "--fail-on-token-id",
    ]:
        assert flag in text
    assert "fault-injection" in text


def test_toml_file_is_below_environment_and_flags(tmp_path):
    toml = tmp_path / "worker.toml"
    toml.write_text('block_size = 8\nmodel = "dummy"\nkv_cache_gib = 2\ndevice = "cpu"\n')
    environ = {"PAGODA_WORKER_CONFIG": str(toml), "PAGODA_WORKER_DEVICE": "cuda"}
    loaded = load_config(
        ["--block-size", "4", "--zmq-endpoint", "tcp://127.0.0.1:5555", "--zmq-allow-insecure-tcp"],
        environ,
    )
    config = loaded.config
    assert (config.block_size, config.model, config.kv_cache_gib) == (4, "dummy", 2.0)
    assert config.device == "cuda"
    assert loaded.sources["block_size"] == "flag"
    assert loaded.sources["model"] == f"toml {toml}"
    assert loaded.sources["device"] == "env PAGODA_WORKER_DEVICE"
    assert loaded.sources["log_level"] == "default"
    printed = describe(loaded)
    assert 'model = "dummy"'.ljust(48) + f"  # toml {toml}" in printed.splitlines()
    assert "# num_kv_blocks (unset)" in printed


@pytest.mark.parametrize(
    ("text", "sentence"),
    [
        ("bogus = 1\n", "unknown key 'bogus'"),
        ('block_size = "big"\n', "'big' is not a valid value for block_size"),
        ("block_size = \n", "cannot read the config file"),
    ],
)
def test_bad_toml_stops_with_a_sentence(tmp_path, capsys, text, sentence):
    toml = tmp_path / "worker.toml"
    toml.write_text(text)
    with pytest.raises(SystemExit) as exited:
        load_config(["--config", str(toml)], {})
    assert exited.value.code == 2
    assert sentence in capsys.readouterr().err
