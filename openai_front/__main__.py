"""`python -m pagoda.openai_front` / `pagoda-openai`: the OpenAI HTTP API on --listen, served
by uvicorn, every request a gRPC call to the scheduler at --target."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

import uvicorn

from pagoda.common.logs import configure_logging
from pagoda.common.systemd import notify, watchdog_interval_s
from pagoda.openai_front.app import build_app
from pagoda.openai_front.config import FrontConfig, describe, load_config
from pagoda.openai_front.upstream import Upstream

log = logging.getLogger("pagoda.openai")
EXIT_CONFIG = 2  # as the other services: a configuration error; restarting cannot fix it
TICK_S = 0.05  # how often the supervising loop looks at uvicorn's state


def uvicorn_config(config: FrontConfig, app: object) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.listen_host,
        port=config.listen_port,
        log_level=config.log_level.lower(),
        # No handlers of uvicorn's own (its default config prints to stdout and stderr in
        # its own format): its loggers propagate to the root handler of configure_logging,
        # so its lines and access log follow --log-format.
        log_config=None,
        limit_concurrency=config.max_concurrent_requests,
        timeout_graceful_shutdown=config.drain_timeout_s,
        ssl_certfile=config.tls_cert,
        ssl_keyfile=config.tls_key,
        lifespan="on",
        server_header=False,
        proxy_headers=False,
    )


async def serve(server: uvicorn.Server, config: FrontConfig) -> int:
    """Run uvicorn (it handles SIGTERM and SIGINT: stop accepting, let requests finish for
    drain_timeout_s); tell systemd when it listens and when it stops, and keep its watchdog
    fed while the event loop turns."""
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(TICK_S)
    if server.started:
        scheme = "https" if config.tls_cert else "http"
        log.info("serving the OpenAI API on %s://%s for %s", scheme, config.listen, config.target)
        notify("READY=1", f"STATUS=serving on {config.listen}")
    next_keepalive_s = 0.0
    while not task.done() and not server.should_exit:
        if time.monotonic() >= next_keepalive_s:
            notify("WATCHDOG=1")
            next_keepalive_s = time.monotonic() + watchdog_interval_s()
        await asyncio.wait({task}, timeout=TICK_S)
    notify("STOPPING=1")
    await task
    return 0 if server.started else 1


def _handled_by_uvicorn(signum: int, frame: object) -> None:
    """uvicorn drains on SIGTERM/SIGINT, then raises the signal again on its way out; by
    then the work is done, so this process ends with status 0 instead of dying by it."""


def main(argv: list[str] | None = None) -> int:
    loaded = load_config(argv)
    if loaded.print_config:
        print(describe(loaded))
        return 0
    config = loaded.config
    configure_logging(config.log_level, config.log_format, service="openai")
    root_cert = None
    if config.tls_root_cert is not None:
        try:
            root_cert = Path(config.tls_root_cert).read_bytes()
        except OSError as exc:
            print(f"pagoda-openai: cannot read --tls-root-cert: {exc}", file=sys.stderr)
            return EXIT_CONFIG
    app = build_app(config, Upstream(config.target, root_cert))
    server = uvicorn.Server(uvicorn_config(config, app))
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _handled_by_uvicorn)
    return asyncio.run(serve(server, config))


if __name__ == "__main__":
    sys.exit(main())
