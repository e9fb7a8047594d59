"""The router's configuration: flags > PAGODA_ROUTER_* environment > TOML file > defaults.

Built once in `__main__` into a frozen `RouterConfig`, validated, then passed down; the
layering itself is pagoda.common.settings, shared with the other services.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagoda.common.logs import add_log_flags, log_setting_problems
from pagoda.common.settings import (
    LoadedConfig,
    add_config_flags,
    load_flags,
    optional_str,
    split_host_port,
)
from pagoda.router.policy import POLICIES, Thresholds

ENV_PREFIX = "PAGODA_ROUTER_"
DEFAULT_LISTEN = "127.0.0.1:50050"


@dataclass(frozen=True, slots=True)
class RouterConfig:
    listen: str = DEFAULT_LISTEN
    # The replicas' gRPC addresses, comma-separated: HOST:PORT,HOST:PORT.
    backends: str = ""
    policy: str = "cache-aware"
    cache_threshold: float = 0.5
    balance_abs_requests: int = 8
    balance_rel: float = 1.5
    # Chunk hashes remembered per replica (64 characters each: 1M is about 64M characters
    # of prompts, some 100 MB of the router's memory per replica at most).
    max_cached_chunks_per_backend: int = 1 << 20
    # PEM roots that signed the replicas' certificates; set: TLS to the replicas.
    tls_root_cert: str | None = None
    # TLS on the router's own listener (both or neither).
    tls_cert: str | None = None
    tls_key: str | None = None
    max_grpc_message_bytes: int = 1024 * 1024
    max_concurrent_streams: int = 1024
    max_concurrent_rpcs: int = 4096
    stream_write_timeout_s: float = 60.0
    health_interval_s: float = 0.5
    # HOST:PORT of Prometheus /metrics over HTTP, unauthenticated; unset: none.
    metrics_address: str | None = None
    # On SIGTERM, seconds in-flight calls may finish before they are cut.
    drain_timeout_s: float = 30.0
    log_level: str = "INFO"
    log_format: str = "text"

    def __post_init__(self) -> None:
        problems = []
        try:
            split_host_port(self.listen)
        except ValueError as exc:
            problems.append(f"--listen: {exc}")
        if not self.backend_addresses:
            problems.append("--backends must name at least one replica (HOST:PORT,...)")
        for address in self.backend_addresses:
            try:
                split_host_port(address)
            except ValueError as exc:
                problems.append(f"--backends: {exc}")
        if len(set(self.backend_addresses)) != len(self.backend_addresses):
            problems.append("--backends names a replica twice")
        if self.policy not in POLICIES:
            problems.append(f"--policy must be one of {', '.join(POLICIES)}")
        if not 0 <= self.cache_threshold <= 1:
            problems.append("--cache-threshold must be between 0 and 1")
        if self.balance_abs_requests < 0:
            problems.append("--balance-abs-requests must be >= 0")
        if not self.balance_rel >= 1:
            problems.append("--balance-rel must be >= 1")
        if self.max_cached_chunks_per_backend < 1:
            problems.append("--max-cached-chunks-per-backend must be >= 1")
        if (self.tls_cert is None) != (self.tls_key is None):
            problems.append("--tls-cert and --tls-key go together")
        if self.max_grpc_message_bytes < 1024:
            problems.append("--max-grpc-message-bytes must be at least 1024")
        if self.max_concurrent_streams < 1:
            problems.append("--max-concurrent-streams must be >= 1")
        if self.max_concurrent_rpcs < 1:
            problems.append("--max-concurrent-rpcs must be >= 1")
        if not self.stream_write_timeout_s > 0:
            problems.append("--stream-write-timeout-s must be > 0")
        if self.metrics_address is not None:
            try:
                split_host_port(self.metrics_address)
            except ValueError as exc:
                problems.append(f"--metrics-address: {exc}")
        if not 0.01 <= self.health_interval_s <= 60:
            problems.append("--health-interval-s must be between 0.01 and 60")
        if not self.drain_timeout_s >= 0:
            problems.append("--drain-timeout-s must be >= 0")
        problems += log_setting_problems(self.log_level, self.log_format)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def backend_addresses(self) -> list[str]:
        return [part.strip() for part in self.backends.split(",") if part.strip()]

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(self.cache_threshold, self.balance_abs_requests, self.balance_rel)


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagoda-router",
        description=(
            "One gRPC address in front of several Pagoda schedulers (replicas, each with "
            "its own workers): each Generate or Chat goes to the replica most likely to "
            "hold its prompt's prefix in cache, unless the loads are out of balance. Every "
            f"flag may also be set through the environment as {ENV_PREFIX}<FLAG> or a key "
            "of the --config TOML file; flags win over the environment, which wins over "
            "the file."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--listen", default=DEFAULT_LISTEN, help="HOST:PORT the router's gRPC API listens on")
    add(
        "--backends",
        default="",
        help="the replicas' gRPC addresses, HOST:PORT,HOST:PORT (each a pagoda-scheduler); "
        "calls carry the caller's metadata (its bearer key) to them unchanged",
    )
    add(
        "--policy",
        default="cache-aware",
        choices=POLICIES,
        help="cache-aware: the replica holding the longest prefix of the prompt, unless "
        "loads are out of balance; least-loaded; round-robin",
    )
    add(
        "--cache-threshold",
        type=float,
        default=0.5,
        help="share of a prompt a replica must hold cached for cache-aware to send it "
        "there rather than to the least loaded replica",
    )
    add(
        "--balance-abs-requests",
        type=int,
        default=8,
        help="loads are out of balance (least loaded wins) when the busiest replica has "
        "more than this many requests in flight beyond the idlest...",
    )
    add(
        "--balance-rel",
        type=float,
        default=1.5,
        help="...and more than this many times as many",
    )
    add(
        "--max-cached-chunks-per-backend",
        type=int,
        default=1 << 20,
        help="prompt chunks (64 characters or 16 token ids) remembered per replica, the "
        "least recently routed forgotten first",
    )
    add(
        "--tls-root-cert",
        type=optional_str,
        default=None,
        help="PEM root certificates of the replicas' TLS certificates; set: TLS to them",
    )
    add("--tls-cert", type=optional_str, default=None, help="PEM certificate chain to serve TLS")
    add("--tls-key", type=optional_str, default=None, help="PEM private key to serve TLS")
    add(
        "--max-grpc-message-bytes",
        type=int,
        default=1024 * 1024,
        help="largest gRPC request accepted, in bytes (set it as the replicas' own)",
    )
    add("--max-concurrent-streams", type=int, default=1024, help="HTTP/2 streams per connection")
    add(
        "--max-concurrent-rpcs",
        type=int,
        default=4096,
        help="calls the router serves at once over all connections (RESOURCE_EXHAUSTED "
        "beyond): each holds its request, up to --max-grpc-message-bytes",
    )
    add(
        "--stream-write-timeout-s",
        type=float,
        default=60.0,
        help="a stream whose client takes no message for this long is ended",
    )
    add(
        "--health-interval-s",
        type=float,
        default=0.5,
        help="seconds between two health checks of each replica (a replica that refuses a "
        "call UNAVAILABLE is skipped at once, until a check says SERVING again)",
    )
    add(
        "--metrics-address",
        type=optional_str,
        default=None,
        help="HOST:PORT for Prometheus metrics over HTTP, unauthenticated (off when unset)",
    )
    add(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight calls may finish before they are cut",
    )
    add_log_flags(parser)
    add_config_flags(parser, environ, ENV_PREFIX)
    return parser


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> LoadedConfig:
    return load_flags(build_parser, RouterConfig, ENV_PREFIX, argv, environ)
