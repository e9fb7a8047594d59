"""Configuration layering: flags > environment > TOML > defaults, validated with a sentence."""

from __future__ import annotations

import pytest

from pagoda.scheduler_svc import settings
from pagoda.scheduler_svc.core.config import ConfigError


def load(argv=(), environ=None):
    loaded, _ = settings.load(list(argv), environ or {})
    return loaded


def test_defaults_are_safe_and_loopback():
    loaded = load()
    assert loaded.config.grpc_address.startswith("127.0.0.1:")
    assert loaded.config.zmq_endpoint.startswith("ipc://")
    assert loaded.config.scheduler.chunked_prefill and loaded.config.scheduler.prefix_caching
    assert set(loaded.sources.values()) == {"default"}


def test_flags_beat_environment_beat_toml(tmp_path):
    toml = tmp_path / "pagoda.toml"
    toml.write_text('admission_policy = "priority"\nmax_active_requests = 7\nworker_grace_s = 3\n')
    loaded = load(
        ["--config", str(toml), "--admission-policy", "pack", "--no-chunked-prefill"],
        {"PAGODA_MAX_ACTIVE_REQUESTS": "9", "PAGODA_PREFIX_CACHING": "false"},
    )
    scheduler = loaded.config.scheduler
    assert scheduler.admission_policy == "pack" and loaded.sources["admission_policy"] == "flag"
    assert scheduler.max_active_requests == 9
    assert loaded.sources["max_active_requests"] == "env PAGODA_MAX_ACTIVE_REQUESTS"
    assert loaded.config.worker_grace_s == 3.0 and loaded.sources["worker_grace_s"].startswith(
        "toml"
    )
    assert scheduler.chunked_prefill is False and scheduler.prefix_caching is False


def test_optional_knobs_can_be_set_and_unset():
    loaded = load(["--prefill-max-tokens", "256"], {"PAGODA_MAX_DECODE_BATCH_SIZE": "none"})
    assert loaded.config.scheduler.prefill_max_tokens == 256
    assert loaded.config.scheduler.max_decode_batch_size is None


@pytest.mark.parametrize(
    "argv, environ, toml, phrase",
    [
        (["--max-num-batched-tokens", "0"], {}, None, "max_num_batched_tokens"),
        (["--max-active-requests", "many"], {}, None, "must be int"),
        ([], {"PAGODA_CHUNKED_PREFILL": "perhaps"}, None, "true or false"),
        ([], {}, "bogus_knob = 1\n", "unknown key 'bogus_knob'"),
        ([], {}, 'max_active_requests = "ten"\n', "must be int"),
        (["--zmq-endpoint", "udp://x"], {}, None, "zmq_endpoint"),
        (["--admission-policy", "random"], {}, None, "admission_policy"),
        ([], {"PAGODA_LOG_FORMAT": "xml"}, None, "log_format must be text or json, got 'xml'"),
    ],
)
def test_bad_values_stop_with_a_sentence(tmp_path, argv, environ, toml, phrase):
    if toml is not None:
        path = tmp_path / "bad.toml"
        path.write_text(toml)
        argv = [*argv, "--config", str(path)]
    with pytest.raises(ConfigError, match=phrase):
        load(argv, environ)


def test_log_format_is_a_setting_like_log_level(tmp_path):
    assert load().config.log_format == "text"
    toml = tmp_path / "pagoda.toml"
    toml.write_text('log_format = "json"\n')
    assert load(["--config", str(toml)]).config.log_format == "json"
    assert load(["--log-format", "json"]).sources["log_format"] == "flag"
    assert "--log-format" in settings.build_parser().format_help()


def test_print_config_names_every_source():
    loaded, print_config = settings.load(["--print-config", "--max-active-requests", "5"], {})
    assert print_config
    text = settings.describe(loaded)
    assert "max_active_requests = 5" in text and "# flag" in text
    assert "admission_policy" in text and "# default" in text


def test_every_knob_has_a_documented_flag():
    help_text = settings.build_parser().format_help()
    for flag in ("--max-num-batched-tokens", "--prefill-max-tokens", "--admission-lookahead",
                 "--force-fifo-every", "--chunked-prefill", "--no-chunked-prefill", "--decode-first",
                 "--prefix-caching", "--max-decode-batch-size", "--prefill-max-batch-size"):  # fmt: skip
        assert flag in help_text
