"""`python -m pagoda.router` / `pagoda-router`: one gRPC address in front of several
scheduler replicas (pagoda.router.proxy)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import grpc

from pagoda.common.logs import configure_logging
from pagoda.common.settings import split_host_port
from pagoda.common.systemd import notify, watchdog_interval_s
from pagoda.router.config import RouterConfig, load_config
from pagoda.router.metrics import router_registry
from pagoda.router.proxy import Router, RouterSettings
from pagoda.router.server import RouterHealth, build_server
from pagoda.scheduler_svc.metrics_http import serve_metrics

log = logging.getLogger("pagoda.router")
EXIT_CONFIG = 2  # as the other services: a configuration error; restarting cannot fix it


def router_settings(config: RouterConfig) -> RouterSettings:
    return RouterSettings(
        policy=config.policy,
        thresholds=config.thresholds,
        max_cached_chunks_per_backend=config.max_cached_chunks_per_backend,
        stream_write_timeout_s=config.stream_write_timeout_s,
        health_interval_s=config.health_interval_s,
    )


def reload_backends(router: Router, config: RouterConfig, argv: list[str] | None) -> None:
    """SIGHUP: read the settings again (flags, environment, the --config file) and route to
    their `backends` from now on. Only the replicas change without a restart; a setting
    that cannot be read keeps the replicas as they were."""
    try:
        loaded = load_config(argv)
    except SystemExit:  # argparse printed why
        log.error("SIGHUP: the settings cannot be read; the replicas stay as they were")
        return
    fresh = loaded.config
    router.set_backends(fresh.backend_addresses, config.drain_timeout_s)
    others = [
        name
        for name in RouterConfig.__dataclass_fields__
        if name != "backends" and getattr(fresh, name) != getattr(config, name)
    ]
    if others:
        log.warning("SIGHUP: %s change only at a restart", ", ".join(others))
    log.info("SIGHUP: routing to %s", ", ".join(fresh.backend_addresses))


async def serve(
    config: RouterConfig,
    credentials: grpc.ChannelCredentials | None,
    argv: list[str] | None = None,
) -> int:
    health = RouterHealth()
    router = Router(
        config.backend_addresses, credentials, router_settings(config), health.on_serving
    )
    try:
        server = build_server(config, router, health)
    except OSError as exc:
        log.error("%s", exc)
        await router.close()
        return EXIT_CONFIG
    await health.start()
    await server.start()
    router.start()
    metrics_server = None
    if config.metrics_address is not None:
        host, port = split_host_port(config.metrics_address)
        metrics_server = await serve_metrics(router_registry(router), host, port)
        log.info("metrics on http://%s/metrics", config.metrics_address)
    log.info(
        "routing pagoda.v1.Generation on %s to %s (%s)",
        config.listen,
        ", ".join(config.backend_addresses),
        config.policy,
    )
    notify("READY=1", f"STATUS=routing on {config.listen}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload_backends, router, config, argv)
    while not stop.is_set():
        notify("WATCHDOG=1")
        try:
            await asyncio.wait_for(stop.wait(), watchdog_interval_s())
        except TimeoutError:
            pass
    notify("STOPPING=1")
    await health.servicer.enter_graceful_shutdown()
    await server.stop(grace=config.drain_timeout_s)
    if metrics_server is not None:
        metrics_server.close()
    await router.close()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    loaded = load_config(argv)
    if loaded.print_config:
        print(loaded.describe())
        return 0
    config = loaded.config
    configure_logging(config.log_level, config.log_format, service="router")
    credentials = None
    try:
        if config.tls_root_cert is not None:
            roots = Path(config.tls_root_cert).read_bytes()
            credentials = grpc.ssl_channel_credentials(root_certificates=roots)
        for name in ("tls_cert", "tls_key"):
            if getattr(config, name) is not None:
                Path(getattr(config, name)).read_bytes()
    except OSError as exc:
        print(f"pagoda-router: cannot read a TLS file: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return asyncio.run(serve(config, credentials, argv))


if __name__ == "__main__":
    sys.exit(main())
