"""Who may call the API and as which tenant: the api_key_file's bearer keys (one tenant
each), the interceptor that checks them, and what follows from them for the rest of the
configuration (cache salting, waiting quotas).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
from pathlib import Path

import grpc

from pagoda.common.secret_files import exposure_warning
from pagoda.scheduler_svc.core import ConfigError
from pagoda.scheduler_svc.settings import ServiceConfig
from pagoda.scheduler_svc.tenants import KeyEntry, TenantDirectory, parse_key_file

log = logging.getLogger("pagoda.auth")

# The one RPC open without the token: a load balancer's or orchestrator's probe. Watch
# is a stream a client keeps open, so it is authenticated like the API.
_OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})


def bearer_token(context) -> str:
    """The caller's `authorization` metadata ("Bearer <key>"), "" when absent."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def tenant_cache_salt(authorization: str, cache_salt: str) -> str:
    """The cache salt of a request under --cache-salt-by-api-key: a digest of the caller's
    key (never the key itself, which then lives in no request) then the request's own salt.
    The digest's fixed length keeps the two parts apart: no (key, salt) pair can pose as
    another, and a tenant's own salts still split its cache further."""
    digest = hashlib.sha256(authorization.encode()).hexdigest()
    return f"{digest}:{cache_salt}"


def resolve_cache_salting(config: ServiceConfig) -> ServiceConfig:
    """`config` with cache_salt_by_api_key decided: unset, it is on when the key file
    holds several keys (several tenants), so that one tenant cannot read another's cached
    prefix from its hits or its time to first token (security review N9)."""
    if config.cache_salt_by_api_key is not None:
        return config
    num_keys = len(read_api_keys(config.api_key_file, warn=False)) if config.api_key_file else 0
    return dataclasses.replace(config, cache_salt_by_api_key=num_keys > 1)


def resolve_tenant_quotas(config: ServiceConfig) -> ServiceConfig:
    """`config` with max_tenant_waiting_requests decided: unset with several keys (several
    tenants), half the waiting queue, so that one tenant cannot fill it (review N3)."""
    scheduler = config.scheduler
    if scheduler.max_tenant_waiting_requests is not None or not config.api_key_file:
        return config
    if len(read_api_keys(config.api_key_file, warn=False)) < 2:
        return config
    cap = max(1, scheduler.max_waiting_requests // 2)
    scheduler = dataclasses.replace(scheduler, max_tenant_waiting_requests=cap)
    return dataclasses.replace(config, scheduler=scheduler)


def read_api_keys(path: str, *, warn: bool = True) -> list[str]:
    """The bearer tokens of an api_key_file (see read_key_entries)."""
    return [entry.key for entry in read_key_entries(path, warn=warn)]


def read_key_entries(path: str, *, warn: bool = True) -> list[KeyEntry]:
    """The lines of an api_key_file: a key, or `name:weight:key`, per line (one tenant
    each); blank lines and # comments skipped; a file holding one key is one line."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read api_key_file: {exc}") from None
    entries = parse_key_file(text, f"api_key_file {path}")
    if not entries:
        raise ConfigError(f"api_key_file {path} is empty")
    if warn:  # once, when the server is built
        warn_if_exposed(path, "the api_key_file")
    return entries


def tenant_directory(config: ServiceConfig) -> TenantDirectory:
    """Who each caller is: the key file's tenants (none without one), and whether the
    front's tenant header is trusted."""
    entries = read_key_entries(config.api_key_file, warn=False) if config.api_key_file else []
    return TenantDirectory(entries, trust_header=config.trust_tenant_header)


def warn_if_exposed(path: str, what: str) -> None:
    warning = exposure_warning(path, what)
    if warning is not None:
        log.warning("%s", warning)


class BearerAuth(grpc.aio.ServerInterceptor):
    """Refuses every RPC but the health Check without `authorization: Bearer <key>` for
    one of the keys (one per tenant)."""

    def __init__(self, api_keys: list[str]) -> None:
        self._expected = [f"Bearer {key}".encode() for key in api_keys]

        async def refuse(request, context) -> None:
            # Status set, no abort (see Refused); the body was dropped unparsed.
            context.set_code(grpc.StatusCode.UNAUTHENTICATED)
            context.set_details("a valid bearer token is required")

        self._refusal = grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=_drop_body)
        self._stream_refusal = grpc.unary_stream_rpc_method_handler(
            refuse, request_deserializer=_drop_body
        )

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in _OPEN_METHODS:
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        token = str(metadata.get("authorization", "")).encode()
        # Every key compared (no early exit), so the time taken tells nothing of which.
        if sum(hmac.compare_digest(token, expected) for expected in self._expected):
            return await continuation(handler_call_details)
        streaming = handler_call_details.method.endswith(("/Generate", "/Chat", "/Watch"))
        return self._stream_refusal if streaming else self._refusal


def _drop_body(data: bytes) -> None:
    """The body of a call refused before authentication: never parsed, never kept."""
    return None
