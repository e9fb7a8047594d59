"""Tenants at the edge: who a call is, read from its API key (or a trusted front's header).

A tenant is the API key that authenticated the call. A key file line is either a bare
key (its tenant is named `key-<first 8 hex digits of its sha256>`, so neither logs nor
metrics reveal it) or `name:weight:key`. Behind a trusted front that authenticates on its
own (--trust-tenant-header), the front's `x-pagoda-tenant` metadata names the tenant. An
unauthenticated deployment is one tenant, DEFAULT_TENANT.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

from pagoda.scheduler_svc.core import ConfigError

DEFAULT_TENANT = "default"
TENANT_HEADER = "x-pagoda-tenant"
# A tenant name labels metrics and logs: short, and nothing a label or a log line must escape.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    weight: float = 1.0  # its share of the worker relative to the others


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """One line of an api_key_file."""

    key: str
    tenant: Tenant


def derived_name(key: str) -> str:
    """The tenant name of a bare key: a digest prefix, never the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def parse_key_line(line: str) -> KeyEntry:
    """`name:weight:key` or a bare key (any line that is not that form)."""
    parts = line.split(":", 2)
    if len(parts) == 3 and _NAME.fullmatch(parts[0]) and parts[2]:
        weight = _weight(parts[1])
        if weight is not None:
            return KeyEntry(parts[2], Tenant(parts[0], weight))
    return KeyEntry(line, Tenant(derived_name(line)))


def parse_key_file(text: str, path: str = "api_key_file") -> list[KeyEntry]:
    """The entries of a key file: blank lines and # comments skipped; a key or a tenant
    name given twice is refused (one key is one tenant)."""
    entries = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            entries.append(parse_key_line(line))
    keys, names = set(), set()
    for entry in entries:
        if entry.key in keys:
            raise ConfigError(f"{path} holds a key twice (tenant {entry.tenant.name})")
        if entry.tenant.name in names:
            raise ConfigError(f"{path} names tenant {entry.tenant.name} twice")
        keys.add(entry.key)
        names.add(entry.tenant.name)
    return entries


def _weight(text: str) -> float | None:
    try:
        weight = float(text)
    except ValueError:
        return None
    return weight if math.isfinite(weight) and weight > 0 else None


class TokenBucket:
    """Tokens per minute for one tenant: holds up to a minute's worth, refills evenly.

    A request is let through while the bucket holds its cost, or is full (a request larger
    than a minute's worth is not refused for ever); the bucket may then go below zero and
    the tenant waits for it to refill. `now` (seconds, monotonic) is passed in.
    """

    __slots__ = ("tokens_per_minute", "level", "last_s")

    def __init__(self, tokens_per_minute: int, now: float) -> None:
        self.tokens_per_minute = tokens_per_minute
        self.level = float(tokens_per_minute)
        self.last_s = now

    def take(self, num_tokens: int, now: float) -> float | None:
        """Take `num_tokens`; None when let through, else the seconds until it would be."""
        capacity = self.tokens_per_minute
        elapsed_s = max(0.0, now - self.last_s)
        self.level = min(capacity, self.level + elapsed_s * capacity / 60.0)
        self.last_s = now
        needed = min(num_tokens, capacity)
        if self.level >= needed:
            self.level -= num_tokens
            return None
        return (needed - self.level) * 60.0 / capacity


class TenantDirectory:
    """Maps a call's metadata to its tenant. Called after authentication (BearerAuth)."""

    def __init__(self, entries: list[KeyEntry], *, trust_header: bool = False) -> None:
        self._by_token = {f"Bearer {entry.key}": entry.tenant for entry in entries}
        self._by_name = {entry.tenant.name: entry.tenant for entry in entries}
        self._trust_header = trust_header
        self.names = [entry.tenant.name for entry in entries]

    @property
    def num_tenants(self) -> int:
        """Tenants the key file names (0 without keys: one default tenant, or the front's)."""
        return len(self._by_token)

    def tenant_of(self, metadata) -> Tenant:
        """The caller's tenant; raises ValueError for a trusted header that names none."""
        authorization = ""
        named = None
        for key, value in metadata or ():
            if isinstance(value, bytes):
                value = value.decode(errors="replace")
            if key == "authorization":
                authorization = value
            elif key == TENANT_HEADER:
                named = value
        if self._trust_header and named is not None:
            if not _NAME.fullmatch(named):
                raise ValueError(
                    f"{TENANT_HEADER} must be 1 to 64 letters, digits, '_', '.' or '-'"
                )
            # A named tenant of the key file keeps its weight.
            return self._by_name.get(named) or Tenant(named)
        tenant = self._by_token.get(authorization)
        return tenant if tenant is not None else Tenant(DEFAULT_TENANT)
