"""The scheduler process's configuration: flags > environment > TOML file > defaults.

Built once in __main__ into a frozen `ServiceConfig` (which embeds the scheduling
knobs as a `SchedulerConfig`), validated, then passed down. This is the only scheduler module that reads
os.environ; the layering itself is pagoda.common.settings, shared with the worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from pagoda.common.logs import LOG_FORMAT_HELP, LOG_FORMATS
from pagoda.common.settings import (
    DEFAULT_GRPC_ADDRESS,
    SettingError,
    default_zmq_endpoint,
    insecure_tcp_problem,
    resolve,
    settings_lines,
)
from pagoda.scheduler_svc.core import ConfigError, SchedulerConfig

ENV_PREFIX = "PAGODA_"


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """Everything the scheduler process needs besides the scheduling knobs."""

    grpc_address: str = DEFAULT_GRPC_ADDRESS
    zmq_endpoint: str = field(default_factory=default_zmq_endpoint)
    model: str = "default"
    metrics_address: str | None = None
    worker_timeout_s: float = 30.0
    worker_grace_s: float = 60.0
    drain_timeout_s: float = 30.0
    default_max_new_tokens: int = 256
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    max_stop_total_bytes: int = 1024
    max_logprobs: int = 20
    max_n: int = 16
    # 1 MiB holds a prompt as long as a 128k context: 131,072 token ids of 3 bytes each
    # (ids below 2**21) or about 4.5 bytes of text per token. Larger only when configured:
    # every request in flight, authenticated or not yet, is held whole (review N1).
    max_grpc_message_bytes: int = 1024 * 1024
    max_concurrent_streams: int = 1024
    max_concurrent_rpcs: int = 4096
    stream_write_timeout_s: float = 60.0
    max_connection_idle_s: float = 600.0
    max_health_watchers: int = 64
    max_tokenize_calls: int = 64
    status_interval_s: float = 10.0
    api_key_file: str | None = None
    cache_salt_by_api_key: bool | None = None
    trust_tenant_header: bool = False
    tenant_tokens_per_minute: int | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    zmq_curve_secret_key: str | None = None
    zmq_curve_authorized_keys: str | None = None
    zmq_allow_insecure_tcp: bool = False
    log_level: str = "INFO"
    log_format: str = "text"
    access_log: bool = False
    overlap_steps: bool | None = None
    late_plan_ahead: bool = True
    max_workers: int = 1
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def validate(self) -> None:
        self.scheduler.validate()
        positive = (
            "worker_timeout_s",
            "worker_grace_s",
            "default_max_new_tokens",
            "max_grpc_message_bytes",
            "max_concurrent_streams",
            "max_concurrent_rpcs",
            "stream_write_timeout_s",
            "max_connection_idle_s",
            "max_health_watchers",
            "max_tokenize_calls",
            "status_interval_s",
            "max_workers",
            "max_n",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "drain_timeout_s",
            "max_stop_strings",
            "max_stop_string_bytes",
            "max_stop_total_bytes",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.max_logprobs <= 20:
            raise ConfigError(f"max_logprobs must be in [0, 20], got {self.max_logprobs}")
        if not self.zmq_endpoint.startswith(("ipc://", "tcp://")):
            raise ConfigError(
                f"zmq_endpoint must be ipc://PATH or tcp://HOST:PORT, got {self.zmq_endpoint!r}"
            )
        if self.tenant_tokens_per_minute is not None and self.tenant_tokens_per_minute < 1:
            raise ConfigError(
                "tenant_tokens_per_minute must be >= 1 (or unset for no cap), "
                f"got {self.tenant_tokens_per_minute}"
            )
        if self.cache_salt_by_api_key and self.api_key_file is None:
            raise ConfigError(
                "cache_salt_by_api_key needs api_key_file: without one every caller's key is "
                "its own choice, and cache_salt in the request does the same"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key must be given together")
        if (self.zmq_curve_secret_key is None) != (self.zmq_curve_authorized_keys is None):
            raise ConfigError(
                "zmq_curve_secret_key and zmq_curve_authorized_keys must be given together"
            )
        problem = insecure_tcp_problem(
            self.zmq_endpoint,
            curve=self.zmq_curve_secret_key is not None,
            allow_insecure_tcp=self.zmq_allow_insecure_tcp,
        )
        if problem is not None:
            raise ConfigError(problem)
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(
                f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}"
            )
        if self.log_format.lower() not in LOG_FORMATS:
            raise ConfigError(f"log_format must be text or json, got {self.log_format!r}")


HELP: dict[str, str] = {
    "grpc_address": "host:port the gRPC API listens on (loopback by default)",
    "zmq_endpoint": "ZeroMQ endpoint the scheduler binds for the worker (ipc:// or tcp://)",
    "model": "tokenizer and chat template source: default, a directory, a .gguf file or a hub id",
    "metrics_address": "host:port for Prometheus metrics over HTTP, unauthenticated (off when "
    "unset; a bare :PORT binds 127.0.0.1)",
    "worker_timeout_s": "seconds a worker with a step in flight may send nothing (no result, "
    "no heartbeat) before it counts as lost; a worker sends heartbeats while a long step "
    "runs, up to its --hang-timeout-s",
    "worker_grace_s": "seconds waiting requests survive without a worker before UNAVAILABLE",
    "drain_timeout_s": "on SIGTERM, seconds in-flight streams may finish before being cancelled",
    "default_max_new_tokens": "max_new_tokens when a request leaves it 0 (clamped to the context)",
    "max_stop_strings": "most stop strings one request may carry",
    "max_stop_string_bytes": "longest stop string in UTF-8 bytes",
    "max_stop_total_bytes": "UTF-8 bytes of one request's stop strings together",
    "max_logprobs": "largest top-n logprobs a request may ask for (at most 20)",
    "max_n": "most samples (n) one request may ask for; they share the prompt's KV blocks",
    "max_grpc_message_bytes": "largest gRPC request accepted, in bytes (refused before "
    "authentication beyond it; the default holds a prompt of a 128k-token context; replies "
    "may be up to 64 MiB or this, whichever is larger)",
    "max_concurrent_streams": "HTTP/2 concurrent streams per connection",
    "max_concurrent_rpcs": "concurrent RPC handlers over all connections (RESOURCE_EXHAUSTED "
    "beyond); a stream its client stopped reading counts until stream_write_timeout_s ends it",
    "stream_write_timeout_s": "a stream whose client takes no message for this long (it "
    "stopped reading) is ended with DEADLINE_EXCEEDED and its request cancelled",
    "max_connection_idle_s": "a connection with no call for this long is closed (GOAWAY)",
    "max_health_watchers": "concurrent grpc.health.v1 Watch streams (RESOURCE_EXHAUSTED beyond); "
    "Watch needs the bearer token when api_key_file is set, Check never does",
    "max_tokenize_calls": "Tokenize calls of a text over 4096 characters (Detokenize calls of "
    "over 1024 ids) queued or running at once on their own thread (RESOURCE_EXHAUSTED beyond; "
    "shorter ones run on the event loop and never wait)",
    "status_interval_s": "seconds between the periodic one-line status logs",
    "api_key_file": "file holding the bearer tokens, one per line: a key, or name:weight:key "
    "(one tenant each; a bare key's tenant is named key-<8 hex of its sha256>); when set, "
    "every RPC must present one of them",
    "cache_salt_by_api_key": "salt the prefix cache by the caller's API key (with the request's "
    "own cache_salt): tenants share no cached block, nor see each other's hits; unset: on "
    "when api_key_file holds more than one key",
    "trust_tenant_header": "take the tenant from the x-pagoda-tenant metadata when a request "
    "carries it (only behind a front that authenticates callers and sets it; anyone else "
    "could name any tenant)",
    "tenant_tokens_per_minute": "per tenant, prompt plus max_new_tokens of the requests it "
    "may start per minute (a token bucket holding a minute's worth; RESOURCE_EXHAUSTED "
    "beyond; unset: no cap)",
    "tls_cert": "PEM certificate chain for gRPC TLS (with --tls-key)",
    "tls_key": "PEM private key for gRPC TLS (with --tls-cert)",
    "zmq_curve_secret_key": "this scheduler's CurveZMQ .key_secret file: encrypts the "
    "worker link and admits only authorized workers (see python -m pagoda.common.curve)",
    "zmq_curve_authorized_keys": "directory of the workers' CurveZMQ public .key files",
    "zmq_allow_insecure_tcp": "accept a tcp:// zmq_endpoint without CurveZMQ keys (plaintext, "
    "unauthenticated: anyone reaching the port can pose as the worker); logged as a warning",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "log_format": LOG_FORMAT_HELP,
    "access_log": "one log line (logger pagoda.access) per Generate or Chat call when it ends: "
    "its id, tenant, peer, trace id (a W3C traceparent's), status, tokens and times; "
    "fields of their own under --log-format json",
    "overlap_steps": "plan and send step N+1 while the worker runs step N (for a worker that "
    "feeds its last sampled tokens; an older one gets one step at a time); unset: on, except "
    "for a CPU worker, whose steps are long enough that planning ahead saves nothing and a "
    "new request would wait one step more",
    "late_plan_ahead": "with overlapped steps, plan step N+1 just before step N is predicted "
    "to end (learned from the worker's step times) rather than as soon as N is sent, so that "
    "requests arriving during N join N+1: about one step less to their first token under "
    "load, the worker still never waiting",
    "max_workers": "workers that may attach at once, each with its own KV pool, all serving "
    "the same model (data parallel: each request is placed on one; a lost worker's requests "
    "move to the others); 1: a new worker replaces the one attached",
    "max_num_batched_tokens": "tokens (prefill + decode) in one step",
    "prefill_max_tokens": "cap on prompt tokens admitted per step (unset: no extra cap)",
    "prefill_max_batch_size": "cap on requests admitted per step (unset: no cap)",
    "max_active_requests": "cap on unfinished running requests; when full, steps only decode",
    "max_decode_batch_size": "decode at most this many per step, round-robin (unset: all)",
    "admission_policy": "fifo, pack (cheapest first within the lookahead), prefix (longest "
    "cached prefix first within the lookahead), deadline (the caller's earliest gRPC "
    "deadline first within the lookahead; no deadline last) or priority",
    "admission_lookahead": "how many waiting requests pack, prefix and deadline look at "
    "(at most 256)",
    "force_fifo_every": (
        "every N-th admission round starts the oldest request first so long prompts never"
        " starve (unset: 4 under pack, prefix and deadline, never otherwise; 0: never)"
    ),
    "chunked_prefill": "split prompts across steps instead of admitting them whole",
    "decode_first": "when prefill and decode cannot share a step, decode wins",
    "prefix_caching": "reuse KV blocks of identical prompt prefixes",
    "max_waiting_requests": "bound of the waiting queue (RESOURCE_EXHAUSTED beyond it)",
    "target_step_ms": "a step with decodes in it carries only the prompt tokens that fit in "
    "this many ms of worker time beside them, as learned from the worker's step times, less "
    "a margin for the model's recent errors (at least 32, never above the token knobs), so a "
    "long prompt does not stall the streams; 0 or none: off (only the token knobs)",
    "fair_share": "share the worker between tenants (API keys) by weighted tokens served: "
    "admission serves the least-served tenant first, preemption takes from the most served; "
    "with one tenant nothing changes",
    "fair_prompt_weight": "weight of a prompt token computed in a tenant's service",
    "fair_generated_weight": "weight of a generated token in a tenant's service",
    "max_tenant_requests": "cap on one tenant's unfinished requests, running and queued "
    "(RESOURCE_EXHAUSTED beyond; per worker with several; unset: none)",
    "max_tenant_waiting_requests": "cap on one tenant's queued requests (RESOURCE_EXHAUSTED "
    "beyond; per worker with several); unset: none with one tenant, half of "
    "max_waiting_requests with several keys, so one cannot fill the queue",
    "speculative_tokens": "n-gram speculation: feed up to this many drafted tokens behind a "
    "decoding request's last token, the ones that followed the latest earlier occurrence of "
    "its last tokens, and keep the samples while they equal the drafts: the same tokens "
    "and logprobs, more of them per step when the output repeats its input; steps are then "
    "planned one at a time (0: off; unset: 4 with a worker whose logits are batch-invariant, "
    "the CPU's, when steps do not overlap, where drafts cannot change a token; else off)",
    "speculative_ngram_min": "shortest suffix of a request's tokens that speculation looks up",
    "speculative_ngram_max": "longest suffix of a request's tokens that speculation looks up",
    "speculative_max_batch": "speculate only in steps that decode at most this many requests "
    "(more: drafts would cost more than they save)",
    "affinity_max_kv_use_gap": "with several workers, one that caches a prefix of a new "
    "request wins it only while its KV use (running and queued blocks, as a share of its "
    "pool) is at most this much above the least-loaded worker's; else the least loaded "
    "wins (0: load only, inf: cache affinity whatever the load)",
}


@dataclass(frozen=True, slots=True)
class Loaded:
    config: ServiceConfig
    sources: dict[str, str]  # knob name -> "flag", "env PAGODA_X", "toml FILE", "default"


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of an annotation such as `int | None`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


def _knob_types() -> dict[str, tuple[type, bool]]:
    knobs = {n: _base_type(t) for n, t in _field_types(ServiceConfig).items() if n != "scheduler"}
    knobs.update({n: _base_type(t) for n, t in _field_types(SchedulerConfig).items()})
    return knobs


def _parse_scalar(name: str, text: str, kind: type, optional: bool) -> Any:
    if optional and text.strip().lower() in ("", "none", "null"):
        return None
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name} must be true or false, got {text!r}")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{name} must be {kind.__name__}, got {text!r}") from None


def _check_toml_value(name: str, value: Any, kind: type, optional: bool) -> Any:
    if value is None and optional:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{name} in the TOML file must be {kind.__name__}, got {value!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagoda-scheduler",
        description=(
            "Pagoda's scheduler: serves pagoda.v1.Generation over gRPC and drives a "
            "gpu_worker over ZeroMQ. Each option may also be set by the environment "
            f"variable {ENV_PREFIX}<NAME> (e.g. {ENV_PREFIX}ADMISSION_POLICY=pack) or a "
            "key of the --config TOML file (top level, underscores); flags win over "
            "the environment, which wins over the file."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="TOML file of settings (keys as in --print-config)")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved settings and where each came from, then exit",
    )
    defaults = _defaults()
    for name, (kind, _) in _knob_types().items():
        flag = _flag(name)
        help_text = f"{HELP.get(name, name)} (default: {defaults[name]})"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, type=str, metavar=kind.__name__.upper(), help=help_text)
    return parser


def _defaults() -> dict[str, Any]:
    service = ServiceConfig()
    values = {n: getattr(service, n) for n in _field_types(ServiceConfig) if n != "scheduler"}
    values.update({n: getattr(service.scheduler, n) for n in _field_types(SchedulerConfig)})
    return values


def load(
    argv: list[str] | None = None, environ: dict[str, str] | None = None
) -> tuple[Loaded, bool]:
    """Parse flags, environment and TOML into a validated config; also return --print-config."""
    environ = dict(os.environ) if environ is None else environ
    args = vars(build_parser().parse_args(argv))
    knobs = _knob_types()
    config_path = args.pop("config", None) or environ.get(ENV_PREFIX + "CONFIG")
    print_config = bool(args.pop("print_config", False))
    flags = {
        name: raw if knobs[name][0] is bool else _parse_scalar(_flag(name), raw, *knobs[name])
        for name, raw in args.items()
    }
    try:
        resolved = resolve(
            _defaults(),
            flags=flags,
            environ=environ,
            env_prefix=ENV_PREFIX,
            config_path=config_path,
            from_toml=lambda name, value, _: _check_toml_value(name, value, *knobs[name]),
            from_env=lambda name, text, variable: _parse_scalar(variable, text, *knobs[name]),
        )
    except SettingError as exc:
        raise ConfigError(str(exc)) from None

    values = resolved.values
    scheduler_names = set(_field_types(SchedulerConfig))
    scheduler = SchedulerConfig(**{n: v for n, v in values.items() if n in scheduler_names})
    config = ServiceConfig(
        scheduler=scheduler, **{n: v for n, v in values.items() if n not in scheduler_names}
    )
    config.validate()
    return Loaded(config, resolved.sources), print_config


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def describe(loaded: Loaded) -> str:
    """One line per setting: name = value  # source, TOML-shaped so it can seed a file."""
    values = _defaults()
    for name in values:
        holder = (
            loaded.config.scheduler if hasattr(loaded.config.scheduler, name) else loaded.config
        )
        values[name] = getattr(holder, name)
    return settings_lines(values, loaded.sources)
