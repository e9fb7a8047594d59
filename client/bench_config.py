"""What one load-generator run does: where, how requests arrive, and what they ask for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pagoda.client.connection import DEFAULT_TARGET

ARRIVALS = ("burst", "interval", "poisson", "closed")
# The request count of a run that its duration ends (BenchConfig.closed_loop).
UNCOUNTED = 1_000_000


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One run of the load generator; validated on construction (ValueError with a sentence).

    Arrival patterns: "burst" sends every request at once; "interval" one every
    `interval_ms`; "poisson" at `rate_per_s` on average (exponential gaps drawn from `seed`);
    "closed" keeps `num_users` requests in flight, each user sending its next request when its
    previous one ends. A run stops after `num_requests` requests or `duration_s`, whichever
    comes first; requests still running at `duration_s` are cancelled and counted unfinished.

    Request i's prompt is a leading tag, then `prompt_repeats[i % len(prompt_repeats)]`
    filler words of about one token each. Tags are unique per request (no accidental prefix
    sharing) unless `same_prompt`; `shared_prefix` puts a common text before the tag.
    """

    target: str = DEFAULT_TARGET
    api_key: str | None = dataclasses.field(default=None, repr=False)
    tls_root_cert: bytes | None = dataclasses.field(default=None, repr=False)
    # Deadline of each request (None: none; the run's duration_s still bounds it).
    request_timeout_s: float | None = None
    num_requests: int = 64
    duration_s: float = 300.0
    arrival: str = "burst"
    interval_ms: float = 100.0
    rate_per_s: float = 8.0
    num_users: int = 8
    seed: int = 0
    prompt_repeats: tuple[int, ...] = (64,)
    shared_prefix: str | None = None
    same_prompt: bool = False
    max_new_tokens: int = 64
    ignore_eos: bool = False
    temperature: float = 0.0
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    # Written into every prompt tag and request id; None: a fresh random tag per run, so a
    # run never hits prefix-cache entries left by an earlier one.
    run_tag: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_repeats", tuple(self.prompt_repeats))
        problems = []
        if self.arrival not in ARRIVALS:
            problems.append(f"arrival must be one of {', '.join(ARRIVALS)}, not {self.arrival!r}")
        positives = {
            "num_requests": self.num_requests,
            "duration_s": self.duration_s,
            "interval_ms": self.interval_ms,
            "rate_per_s": self.rate_per_s,
            "num_users": self.num_users,
            "max_new_tokens": self.max_new_tokens,
        }
        problems += [
            f"{name} must be positive, got {value}"
            for name, value in positives.items()
            if value <= 0
        ]
        if not self.prompt_repeats or any(repeats < 1 for repeats in self.prompt_repeats):
            problems.append(f"prompt_repeats must be counts >= 1, got {list(self.prompt_repeats)}")
        if self.same_prompt and self.shared_prefix is not None:
            problems.append("same_prompt and shared_prefix exclude each other")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        for name in ("slo_ttft_ms", "slo_itl_ms", "request_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                problems.append(f"{name} must be positive, got {value}")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def closed_loop(cls, num_users: int, duration_s: float, **fields: Any) -> BenchConfig:
        """`num_users` users that each send a request when their last one ends, for
        `duration_s` (the count never ends the run first)."""
        return cls(
            arrival="closed",
            num_users=num_users,
            num_requests=UNCOUNTED,
            duration_s=duration_s,
            **fields,
        )

    @property
    def prompt_mode(self) -> str:
        if self.same_prompt:
            return "same"
        return "unique" if self.shared_prefix is None else "shared-prefix"

    @property
    def arrival_label(self) -> str:
        """A short human description, e.g. "poisson 8/s" or "closed 4 users"."""
        if self.arrival == "interval":
            return f"interval {self.interval_ms:g} ms"
        if self.arrival == "poisson":
            return f"poisson {self.rate_per_s:g}/s"
        if self.arrival == "closed":
            return f"closed {self.num_users} users"
        return "burst"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, without secrets: the API key and certificate become booleans."""
        values = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name not in ("api_key", "tls_root_cert")
        }
        values["prompt_repeats"] = list(self.prompt_repeats)
        values["uses_api_key"] = self.api_key is not None
        values["uses_tls"] = self.tls_root_cert is not None
        return values
