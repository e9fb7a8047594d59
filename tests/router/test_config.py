"""pagoda-router's settings: flags > PAGODA_ROUTER_* > TOML > defaults, validated."""

from __future__ import annotations

import pytest

from pagoda.router.config import load_config


def test_backends_are_a_comma_separated_list():
    config = load_config(["--backends", "127.0.0.1:1, [::1]:2"], environ={}).config
    assert config.backend_addresses == ["127.0.0.1:1", "[::1]:2"]
    assert config.listen == "127.0.0.1:50050"


def test_the_environment_and_the_file_set_what_flags_do_not(tmp_path):
    toml = tmp_path / "router.toml"
    toml.write_text('backends = "127.0.0.1:7"\npolicy = "round-robin"\n')
    environ = {"PAGODA_ROUTER_CONFIG": str(toml), "PAGODA_ROUTER_POLICY": "least-loaded"}
    loaded = load_config([], environ=environ)
    assert loaded.config.backend_addresses == ["127.0.0.1:7"]
    assert loaded.config.policy == "least-loaded"
    assert loaded.sources["policy"] == "env PAGODA_ROUTER_POLICY"


@pytest.mark.parametrize(
    "argv, sentence",
    [
        ([], "--backends must name at least one replica"),
        (["--backends", "nowhere"], "is not HOST:PORT"),
        (["--backends", "127.0.0.1:1,127.0.0.1:1"], "names a replica twice"),
        (["--backends", "127.0.0.1:1", "--cache-threshold", "2"], "--cache-threshold"),
        (["--backends", "127.0.0.1:1", "--balance-rel", "0.5"], "--balance-rel"),
        (["--backends", "127.0.0.1:1", "--tls-cert", "c.pem"], "go together"),
    ],
)
def test_bad_settings_exit_with_a_sentence(argv, sentence, capsys):
    with pytest.raises(SystemExit) as exited:
        load_config(argv, environ={})
    assert exited.value.code == 2
    assert sentence in capsys.readouterr().err
