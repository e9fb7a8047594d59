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


def test_the_router_listens_as_a_scheduler_does(monkeypatch):
    """Its listener takes the scheduler's options (pagoda.common.listener): a client that
    pings every 30 s, as the scheduler allows, is not sent away by the router either."""
    import grpc

    from pagoda.common.listener import listener_options
    from pagoda.router.server import build_server

    class Built(Exception):
        pass

    def server(*, interceptors, options):
        raise Built(options)

    monkeypatch.setattr(grpc.aio, "server", server)
    config = load_config(["--backends", "127.0.0.1:1"], environ={}).config
    with pytest.raises(Built) as built:
        build_server(config, None, None)
    (options,) = built.value.args
    assert options == listener_options(config.max_grpc_message_bytes, config.max_concurrent_streams)
    assert ("grpc.http2.min_ping_interval_without_data_ms", 30_000) in options
