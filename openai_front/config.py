"""The front's configuration: flags > PAGODA_OPENAI_* environment > TOML file > defaults.

Built once in `__main__` into a frozen `FrontConfig`, validated, then passed down. This is
the only module of the front that reads the environment; the layering itself is
pagoda.common.settings, shared with the scheduler and the worker.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagoda.common.logs import add_log_flags, log_setting_problems
from pagoda.common.settings import (
    DEFAULT_GRPC_ADDRESS,
    LoadedConfig,
    add_config_flags,
    load_flags,
    optional_str,
    split_host_port,
)

ENV_PREFIX = "PAGODA_OPENAI_"
DEFAULT_LISTEN = "127.0.0.1:8000"
MAX_N = 128  # a sanity bound on the --max-n setting itself


@dataclass(frozen=True, slots=True)
class FrontConfig:
    listen: str = DEFAULT_LISTEN
    target: str = DEFAULT_GRPC_ADDRESS
    # PEM roots that signed the scheduler's certificate; set: the gRPC channel uses TLS.
    tls_root_cert: str | None = None
    # HTTPS on the front's own listener (both or neither).
    tls_cert: str | None = None
    tls_key: str | None = None
    # Largest `n` (choices per prompt, times the prompts of one /v1/completions call): each is
    # its own gRPC request until the gRPC API has `n`.
    max_n: int = 16
    max_body_bytes: int = 8 * 1024 * 1024
    # HTTP requests in flight before uvicorn answers 503 (uvicorn's limit_concurrency).
    max_concurrent_requests: int = 1024
    # On SIGTERM, seconds in-flight requests may finish before their connections are closed.
    drain_timeout_s: float = 30.0
    log_level: str = "INFO"
    log_format: str = "text"  # text or json lines (pagoda.common.logs), uvicorn's too

    def __post_init__(self) -> None:
        problems = []
        for name in ("listen", "target"):
            try:
                split_host_port(getattr(self, name))
            except ValueError as exc:
                problems.append(f"--{name}: {exc}")
        if (self.tls_cert is None) != (self.tls_key is None):
            problems.append("--tls-cert and --tls-key go together")
        if not 1 <= self.max_n <= MAX_N:
            problems.append(f"--max-n must be between 1 and {MAX_N}")
        if self.max_body_bytes < 1024:
            problems.append("--max-body-bytes must be at least 1024")
        if self.max_concurrent_requests < 1:
            problems.append("--max-concurrent-requests must be at least 1")
        if not self.drain_timeout_s >= 0:
            problems.append("--drain-timeout-s must be >= 0")
        problems += log_setting_problems(self.log_level, self.log_format)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def listen_host(self) -> str:
        return split_host_port(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return split_host_port(self.listen)[1]


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagoda-openai",
        description=(
            "Pagoda's OpenAI-compatible HTTP front: serves /v1/models, /v1/completions and "
            "/v1/chat/completions as a client of the scheduler's gRPC API. Every flag may "
            f"also be set through the environment as {ENV_PREFIX}<FLAG> (e.g. "
            f"{ENV_PREFIX}TARGET=10.0.0.5:50051) or a key of the --config TOML file; flags "
            "win over the environment, which wins over the file."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--listen", default=DEFAULT_LISTEN, help="HOST:PORT the HTTP API listens on")
    add(
        "--target",
        default=DEFAULT_GRPC_ADDRESS,
        help="HOST:PORT of the scheduler's gRPC API; each call carries the HTTP caller's "
        "Authorization: Bearer key as its gRPC metadata",
    )
    add(
        "--tls-root-cert",
        type=optional_str,
        default=None,
        help="PEM root certificates of the scheduler's TLS certificate; set: TLS to the target",
    )
    add("--tls-cert", type=optional_str, default=None, help="PEM certificate chain for HTTPS")
    add("--tls-key", type=optional_str, default=None, help="PEM private key for HTTPS")
    add(
        "--max-n",
        type=int,
        default=16,
        help="largest n (choices per prompt, times the prompts of one completions call); "
        "each choice is one gRPC request",
    )
    add(
        "--max-body-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="largest HTTP request body (413 beyond)",
    )
    add(
        "--max-concurrent-requests",
        type=int,
        default=1024,
        help="HTTP requests in flight before new ones are answered 503",
    )
    add(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests may finish before they are cut",
    )
    add_log_flags(parser)
    add_config_flags(parser, environ, ENV_PREFIX)
    return parser


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> LoadedConfig:
    """Flags > environment > TOML file > defaults, validated (pagoda.common.settings)."""
    return load_flags(build_parser, FrontConfig, ENV_PREFIX, argv, environ)


def describe(loaded: LoadedConfig) -> str:
    """One line per setting, `name = value  # source`, as the other services print them."""
    return loaded.describe()
