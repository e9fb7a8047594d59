"""`python -m pagoda.scheduler_svc` / `pagoda-scheduler`: the gRPC API in front of one worker,
or of several (--max-workers, one lane each: front.py)."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from pagoda.common import curve, transport
from pagoda.common.logs import configure_logging
from pagoda.common.systemd import notify, watchdog_interval_s
from pagoda.scheduler_svc import settings
from pagoda.scheduler_svc.api import SERVICE_NAME, GenerationServicer
from pagoda.scheduler_svc.auth import resolve_cache_salting, resolve_tenant_quotas
from pagoda.scheduler_svc.core import ConfigError
from pagoda.scheduler_svc.detokenizer import IncrementalDetokenizer
from pagoda.scheduler_svc.front import Front
from pagoda.scheduler_svc.gc_tuning import collect_young_when_quiet, tune_gc
from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.server import build_server
from pagoda.scheduler_svc.settings import ServiceConfig
from pagoda.scheduler_svc.tokenizer import TextTokenizer, load_tokenizer
from pagoda.scheduler_svc.worker_link import WorkerLink

log = logging.getLogger("pagoda.scheduler")


def resolve_tokenizer_dir(model: str) -> Path:
    """The directory holding the tokenizer of `model` (the same spec the worker takes).

    Resolution may convert a GGUF file, which needs torch; it runs in a child process
    so this process never imports torch. `dummy` uses the default model's tokenizer.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    spec = "default" if model == "dummy" else model
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.gpu_worker.model_loader", spec],
        stdout=subprocess.PIPE,
        text=True,
    )
    if result.returncode != 0 or not result.stdout.strip():
        raise ConfigError(f"cannot find the tokenizer of model {model!r} (see the message above)")
    return Path(result.stdout.strip().splitlines()[-1])


CurveSettings = tuple[curve.KeyPair | None, frozenset[bytes]]


def load_curve(config: ServiceConfig) -> CurveSettings:
    """This scheduler's CurveZMQ keys and the workers' public keys, when configured."""
    if config.zmq_curve_secret_key is None:
        return None, frozenset()
    try:
        return (
            curve.load_key_pair(config.zmq_curve_secret_key),
            curve.load_authorized_keys(config.zmq_curve_authorized_keys),
        )
    except curve.CurveKeyError as exc:
        raise ConfigError(str(exc)) from None


async def serve(
    config: ServiceConfig,
    tokenizer: TextTokenizer,
    model_id: str,
    curve_settings: CurveSettings,
) -> int:
    config = resolve_tenant_quotas(config)
    metrics = Metrics()
    health_servicer = None
    background: set[asyncio.Task] = set()

    def on_worker_change(attached: bool) -> None:
        status = "SERVING" if attached and not front.draining else "NOT_SERVING"
        for service in ("", SERVICE_NAME):
            task = asyncio.create_task(health_servicer.set(service, _health_status(status)))
            background.add(task)
            task.add_done_callback(background.discard)

    try:
        transport.prepare_ipc_directory(config.zmq_endpoint)
    except transport.UnsafeSocketDirectory as exc:
        raise ConfigError(str(exc)) from None
    link = WorkerLink(config.zmq_endpoint, *curve_settings, max_workers=config.max_workers)
    front = Front(
        config.scheduler,
        link,
        metrics,
        detokenizer_factory=lambda: IncrementalDetokenizer(tokenizer),
        worker_timeout_s=config.worker_timeout_s,
        worker_grace_s=config.worker_grace_s,
        status_interval_s=config.status_interval_s,
        on_worker_change=on_worker_change,
        overlap_steps=config.overlap_steps,
        late_plan_ahead=config.late_plan_ahead,
    )
    config = resolve_cache_salting(config)
    if config.cache_salt_by_api_key:
        log.info("the prefix cache is salted by API key: tenants share no cached block")
    servicer = GenerationServicer(front, metrics, tokenizer, config, model_id)
    server, health_servicer = build_server(config, servicer)
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, _health_status("NOT_SERVING"))
    metrics.watch(lambda: front.stats, lambda: front.worker is not None)
    metrics.watch_workers(front.worker_stats)
    metrics.watch_tenants(front.tenant_stats)
    metrics_server = None
    if config.metrics_address:
        metrics_server = await metrics.serve(config.metrics_address)
        log.info("metrics on http://%s/metrics", config.metrics_address)

    await server.start()
    await link.start(front)
    front_task = asyncio.create_task(front.run(), name="front")
    log.info("serving pagoda.v1.Generation on %s", config.grpc_address)
    notify("READY=1", f"STATUS=serving on {config.grpc_address}")

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    watchdog = asyncio.create_task(_watchdog(front_task, front.is_turning))
    collector = asyncio.create_task(collect_young_when_quiet(), name="gc-young")
    done, _ = await asyncio.wait(
        {asyncio.create_task(stop.wait()), front_task}, return_when=asyncio.FIRST_COMPLETED
    )
    if front_task in done and front_task.exception() is not None:
        log.error("the step loop failed", exc_info=front_task.exception())
        await server.stop(grace=None)
        return 1

    notify("STOPPING=1")
    front.stop_accepting()
    await health_servicer.enter_graceful_shutdown()
    await front.drain(config.drain_timeout_s)
    watchdog.cancel()
    collector.cancel()
    if metrics_server is not None:
        metrics_server.close()
    front.stop()
    await server.stop(grace=1.0)
    await asyncio.gather(front_task, return_exceptions=True)
    await link.close()
    log.info("stopped")
    return 0


async def _watchdog(front_task: asyncio.Task, is_turning: Callable[[], bool]) -> None:
    """systemd WatchdogSec keep-alives while the step loop turns: a loop stuck in an await
    gets none, so systemd restarts the service (Restart=on-failure)."""
    interval_s = watchdog_interval_s()
    withheld = False
    while not front_task.done():
        if is_turning():
            notify("WATCHDOG=1")
            withheld = False
        elif not withheld:
            log.error("the step loop is stuck; withholding systemd watchdog keep-alives")
            withheld = True
        await asyncio.sleep(interval_s)


def _health_status(name: str):
    from grpc_health.v1 import health_pb2

    return getattr(health_pb2.HealthCheckResponse, name)


def main(argv: list[str] | None = None) -> int:
    try:
        loaded, print_config = settings.load(argv)
    except ConfigError as exc:
        print(f"pagoda-scheduler: {exc}", file=sys.stderr)
        return 2
    if print_config:
        print(settings.describe(loaded))
        return 0
    config = loaded.config
    configure_logging(config.log_level, config.log_format, service="scheduler")
    try:
        curve_settings = load_curve(config)
        tokenizer_dir = resolve_tokenizer_dir(config.model)
        tokenizer = load_tokenizer(tokenizer_dir)
        tune_gc()
        return asyncio.run(serve(config, tokenizer, config.model, curve_settings))
    except ConfigError as exc:
        print(f"pagoda-scheduler: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
