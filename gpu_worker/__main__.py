"""`python -m pagoda.gpu_worker` / `pagoda-worker`: parse flags, build the engine, serve."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from pagoda.common import curve
from pagoda.common.logs import configure_logging
from pagoda.common.settings import insecure_tcp_warning
from pagoda.common.transport import UnsafeSocketDirectory
from pagoda.gpu_worker.config import (
    QuantizationError,
    WorkerConfig,
    describe,
    load_config,
)
from pagoda.gpu_worker.engine import Engine
from pagoda.gpu_worker.model_loader import ModelNotFoundError
from pagoda.gpu_worker.server import EXIT_REFUSED, WorkerServer, prepare_endpoint

log = logging.getLogger("pagoda.worker")


def build_engine(config: WorkerConfig) -> Engine:
    if config.is_dummy:
        from pagoda.gpu_worker.dummy_engine import DummyEngine

        return DummyEngine(
            block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks,
            max_context_tokens=config.max_context_tokens,
            fail_on_token_id=config.fail_on_token_id,
            step_ms=config.dummy_step_ms,
            crash_on_token_id=config.dummy_crash_on_token_id,
        )
    from pagoda.gpu_worker.paged_engine import load_engine  # torch is imported only here

    return load_engine(config)


def load_curve(config: WorkerConfig) -> tuple[curve.KeyPair, bytes] | None:
    """This worker's CurveZMQ keys and the scheduler's public key, when configured."""
    if config.zmq_curve_secret_key is None:
        return None
    return (
        curve.load_key_pair(config.zmq_curve_secret_key),
        curve.load_public_key(config.zmq_curve_server_key),
    )


def main(argv: Sequence[str] | None = None) -> int:
    loaded = load_config(argv)
    if loaded.print_config:
        print(describe(loaded))
        return 0
    config = loaded.config
    configure_logging(config.log_level, config.log_format, service="worker")
    warning = insecure_tcp_warning(
        config.zmq_endpoint, curve=config.zmq_curve_secret_key is not None
    )
    if warning is not None:
        log.warning("%s", warning)
    try:
        curve_client = load_curve(config)
    except curve.CurveKeyError as exc:
        log.error("%s", exc)
        return EXIT_REFUSED
    try:
        prepare_endpoint(config.zmq_endpoint)
    except UnsafeSocketDirectory as exc:
        log.error("%s", exc)
        return EXIT_REFUSED
    # torchrun's WORLD_SIZE > 1 without the flag is refused there (its ranks must match).
    if config.tensor_parallel_size > 1 or os.environ.get("WORLD_SIZE", "1") != "1":
        from pagoda.gpu_worker import tensor_parallel  # imports torch

        tensor_parallel.exit_process(tensor_parallel.run(config, curve_client))
    try:
        engine = build_engine(config)
    except (ModelNotFoundError, QuantizationError) as exc:
        log.error("cannot load the model: %s", exc)
        return EXIT_REFUSED
    return WorkerServer(
        engine, config.zmq_endpoint, curve_client, hang_timeout_s=config.hang_timeout_s
    ).run()


if __name__ == "__main__":
    sys.exit(main())
