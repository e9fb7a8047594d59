"""What `make bench` measures: scheduler-knob scenarios and the workloads shared with the peers.

A scenario is one question about a scheduler knob, answered by running the same workload
against schedulers started with different flags (its variants); the first variant is the
baseline every other one is compared with. A peer workload is a burst that Pagoda and the
in-process `transformers` peers all serve, so their numbers sit in one table.

Sizes are chosen so the whole suite, peers included, takes about 15 minutes on 2 CPU cores
(`--quick`: about 2 minutes); every workload ignores EOS so variants generate the same tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagoda.client.bench_config import BenchConfig
from pagoda.client.bench_workload import filler_text

# A hard cap on any one run, so a stuck server cannot hold the suite forever.
RUN_DURATION_CAP_S = 240.0
# two-tenants: the probe's column on an idle server, and those it is held against.
IDLE_PROBE, PROBE_UNDER_FLOOD, FLOOD_WITH_PROBE = "idle: probe", "on: probe", "on: flood"

# The scenarios `--quick` keeps (smaller).
QUICK_SCENARIOS = ("prefill-budget", "prefix-caching")

# Left-padded batch size of the static-batch peer: its fastest on this machine (32 beat 16).
STATIC_BATCH_SIZE = 32

# Peer names, in the order they run and are printed.
PEER_GENERATE = "hf generate()"
PEER_STATIC = f"hf static b{STATIC_BATCH_SIZE}"
PEER_CONTINUOUS = "hf generate_batch"
PEERS = (PEER_GENERATE, PEER_STATIC, PEER_CONTINUOUS)
# llama.cpp's server (benchmarks.llama_server), when `make llama-server` has built it; it runs
# before the transformers peers.
PEER_LLAMA = "llama-server"
ALL_PEERS = (PEER_LLAMA, *PEERS)
# The same llama-server driven through its /v1/completions by the OpenAI peer's client
# (benchmarks.openai_peer), on llama-server's workloads; only when named.
PEER_LLAMA_OPENAI = "llama-server /v1"
KNOWN_PEERS = (PEER_LLAMA, PEER_LLAMA_OPENAI, *PEERS)
# `--peer` names on the command line (besides openai=URL, see benchmarks.openai_peer).
PEER_KEYS = {
    "llama-server": PEER_LLAMA,
    "llama-server-openai": PEER_LLAMA_OPENAI,
    "generate": PEER_GENERATE,
    "static": PEER_STATIC,
    "generate-batch": PEER_CONTINUOUS,
}
# llama-server's --parallel: a slot for every request of a 64-request burst; 16 where long
# prompts are mixed in (the issue 15 comparison: more slots only made its steps longer).
LLAMA_PARALLEL = 64
LLAMA_PARALLEL_MIXED = 16


@dataclass(frozen=True, slots=True)
class Variant:
    """One column of a scenario: scheduler flags and the workload run against them."""

    label: str
    scheduler_args: tuple[str, ...]
    workload: BenchConfig
    # The label of the variant this one is compared with (None: the scenario's first); a
    # variant naming itself is a baseline of its own.
    compare_to: str | None = None
    # Other tenants: (label, workload) pairs run at the same time as `workload`, against
    # the same scheduler, each workload with its own `api_key` (Scenario.api_keys).
    alongside: tuple[tuple[str, BenchConfig], ...] = ()
    # Seconds `workload` starts after those alongside: it meets them in their steady
    # state, not their first burst of prompts.
    start_after_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    title: str
    # What the comparison is meant to show, and the team's earlier result to reproduce.
    question: str
    seed_result: str
    variants: tuple[Variant, ...]
    # (tenant name, API key) of each line of the key file its schedulers start with; none:
    # no keys (then no variant runs workloads alongside).
    api_keys: tuple[tuple[str, str], ...] = ()

    @property
    def baselines(self) -> dict[str, str]:
        """Each run's label -> the label of the run it is compared with: a variant's, the
        variant's baseline; the n-th workload alongside, the n-th alongside that baseline."""
        first = self.variants[0].label
        by_label = {v.label: v for v in self.variants}
        baselines = {}
        for variant in self.variants:
            baseline = by_label[variant.compare_to or first]
            baselines[variant.label] = baseline.label
            for (label, _), (baseline_label, _) in zip(
                variant.alongside, baseline.alongside, strict=True
            ):
                baselines[label] = baseline_label
        return baselines


@dataclass(frozen=True, slots=True)
class PeerWorkload:
    """A burst served by Pagoda (default knobs) and by each peer in `peer_max_requests`."""

    name: str
    title: str
    workload: BenchConfig
    # Requests each peer is given (the first n of the workload); fewer than the workload's
    # num_requests only where a peer would take minutes, and the table says so. A peer not
    # named here does not run the workload (the transformers peers serve bursts only).
    peer_max_requests: dict[str, int]
    llama_parallel: int = LLAMA_PARALLEL


def _workload(**fields) -> BenchConfig:
    fields.setdefault("ignore_eos", True)
    fields.setdefault("duration_s", RUN_DURATION_CAP_S)
    return BenchConfig(**fields)


def _closed_loop(num_users: int, duration_s: float, **fields) -> BenchConfig:
    fields.setdefault("ignore_eos", True)
    return BenchConfig.closed_loop(num_users, duration_s, **fields)


def _scaled(count: int, quick: bool, quick_count: int) -> int:
    return quick_count if quick else count


def build_scenarios(*, quick: bool = False, salt: str = "bench") -> list[Scenario]:
    """Every scenario; `quick` keeps a smaller version of the ones marked for `--quick`.

    `salt` makes shared system prompts unique to one suite run, so a long-lived server
    (BENCH_TARGET) cannot answer them from an earlier run's prefix cache.
    """
    scenarios = [
        _prefill_budget(quick),
        _chunked_prefill(quick),
        _admission_pack(quick),
        _active_cap(quick),
        _prefix_caching(quick, salt),
        _two_tenants(quick, salt),
    ]
    if quick:
        return [s for s in scenarios if s.name in QUICK_SCENARIOS]
    return scenarios


def _trickle(quick: bool) -> BenchConfig:
    """One 512-token prompt in every four, a request a second: about 8 decoding at a time."""
    return _workload(
        num_requests=_scaled(20, quick, 8),
        arrival="interval",
        interval_ms=1000,
        prompt_repeats=(512, 16, 16, 16),
        max_new_tokens=32,
    )


def _prefill_budget(quick: bool) -> Scenario:
    trickle = _trickle(quick)
    return Scenario(
        name="prefill-budget",
        title="prefill token budget vs none, trickle of 3 short + 1 long prompts",
        question="Does capping prompt tokens per step keep decode steps short while a 512-token "
        "prompt is admitted (lower ITL p99 for the running requests)?",
        seed_result="ITL p99 438 -> 340 ms",
        variants=(
            Variant("no budget", (), trickle),
            Variant("prefill 128", ("--prefill-max-tokens", "128"), trickle),
        ),
    )


def _chunked_prefill(quick: bool) -> Scenario:
    trickle = _trickle(quick)
    budget = ("--max-num-batched-tokens", "256")
    return Scenario(
        name="chunked-prefill",
        title="chunked prefill on vs off (256-token step budget), trickle of 3 short + 1 long",
        question="Does splitting a 512-token prompt over steps lower TTFT p99 and ITL p99 "
        "together, or trade one for the other?",
        seed_result="(new comparison)",
        variants=(
            Variant("unchunked", (*budget, "--no-chunked-prefill"), trickle),
            Variant("chunked", (*budget, "--chunked-prefill"), trickle),
        ),
    )


def _admission_pack(quick: bool) -> Scenario:
    # Issue 24 item 9's head-of-line burst: one ~512-token prompt in every four, at most 8
    # decodes a step, pack looking 64 deep with every 8th round FIFO.
    burst = _workload(
        num_requests=_scaled(48, quick, 16),
        prompt_repeats=(512, 16, 16, 16),
        max_new_tokens=16,
    )
    common = ("--max-decode-batch-size", "8")
    unchunked = (*common, "--prefill-max-tokens", "256", "--no-chunked-prefill")
    pack = ("--admission-policy", "pack", "--admission-lookahead", "64", "--force-fifo-every", "8")
    chunked = (*common, "--max-num-batched-tokens", "256", "--chunked-prefill")
    return Scenario(
        name="admission-pack",
        title="pack vs fifo admission on a head-of-line burst (prefill budget 256, unchunked), "
        "and pack with chunked prefill",
        question="Do short prompts stuck behind 512-token ones get their first token sooner "
        "when `pack` admits the cheapest first, and does chunking (256-token steps, decodes "
        "first) lower ITL p99 below FIFO's?",
        seed_result="TTFT p99 -39.7% with pack",
        variants=(
            Variant("fifo", (*unchunked, "--admission-policy", "fifo"), burst),
            Variant("pack", (*unchunked, *pack), burst),
            Variant("pack, chunked", (*chunked, *pack), burst, compare_to="fifo"),
        ),
    )


def _active_cap(quick: bool) -> Scenario:
    burst = _workload(
        num_requests=_scaled(48, quick, 24),
        prompt_repeats=(128, 32, 32, 32),
        max_new_tokens=32,
    )
    pack = ("--admission-policy", "pack")
    return Scenario(
        name="active-cap",
        title="max_active_requests cap under pack, burst of 128- and 32-token prompts",
        question="Does capping running requests trade a longer TTFT for smoother decoding "
        "(lower ITL and TPOT p99)?",
        seed_result="ITL p99 -40.5%, TPOT p99 -35%, TTFT up",
        variants=(
            Variant("pack, no cap", pack, burst),
            Variant("pack, cap 16", (*pack, "--max-active-requests", "16"), burst),
        ),
    )


def _prefix_caching(quick: bool, salt: str) -> Scenario:
    count = _scaled(24, quick, 8)
    same = _workload(num_requests=count, same_prompt=True, prompt_repeats=(256,), max_new_tokens=16)
    # About 256 tokens of system prompt before each unique question.
    system = f"[system {salt}] You are a helpful assistant.{filler_text(248)}"
    shared = _workload(
        num_requests=count, shared_prefix=system, prompt_repeats=(16,), max_new_tokens=16
    )
    on, off = ("--prefix-caching",), ("--no-prefix-caching",)
    return Scenario(
        name="prefix-caching",
        title="prefix caching on vs off: a same-prompt burst and a shared system prompt",
        question="Are identical prompts in one burst (batched misses) computed once, and is a "
        "shared system prompt reused, and what does it do to TTFT and throughput?",
        seed_result="TTFT p50 2.9x lower, throughput 1.5x with caching",
        variants=(
            Variant("same, off", off, same),
            Variant("same, on", on, same, compare_to="same, off"),
            Variant("shared, off", off, shared, compare_to="shared, off"),
            Variant("shared, on", on, shared, compare_to="shared, off"),
        ),
    )


def _two_tenants(quick: bool, salt: str) -> Scenario:
    # Issue 27 item 5: one key floods with closed-loop streams that hold every slot, the
    # other sends short requests one after another; keys unique to one suite run.
    flood_key, probe_key = f"flood-{salt}-0123456789", f"probe-{salt}-0123456789"
    duration_s = 10.0 if quick else 30.0
    flood = _closed_loop(
        24,
        duration_s,
        prompt_repeats=(32,),
        max_new_tokens=64,
        api_key=flood_key,
    )
    # The probe starts once the flood's first prompts are in and ends with it.
    settle_s = 2.0 if quick else 5.0
    probe = _closed_loop(
        1,
        duration_s - settle_s,
        prompt_repeats=(8,),
        max_new_tokens=4,
        api_key=probe_key,
    )
    # The probe alone, after the flood's runs: its idle TTFT, the goal's unit.
    idle_probe = dataclasses.replace(probe, duration_s=duration_s / 3)
    cap = ("--max-active-requests", "8")
    return Scenario(
        name="two-tenants",
        title="two API keys, fair share off vs on: 24 closed-loop streams of 64 tokens from "
        "one (8 running at most) while the other sends 4-token requests one after another; "
        "then the latter alone (its idle TTFT)",
        question="Does the second key get its first token within a few steps of asking while "
        "the first holds every slot, and what share of the tokens does each get?",
        seed_result="dummy worker, 600 streams: probe TTFT p99 10.5-14.1 s off, 203-283 ms on",
        variants=(
            Variant(
                "off: probe",
                (*cap, "--no-fair-share"),
                probe,
                alongside=(("off: flood", flood),),
                start_after_s=settle_s,
            ),
            Variant(
                PROBE_UNDER_FLOOD,
                (*cap, "--fair-share"),
                probe,
                compare_to="off: probe",
                alongside=((FLOOD_WITH_PROBE, flood),),
                start_after_s=settle_s,
            ),
            Variant(IDLE_PROBE, (*cap, "--fair-share"), idle_probe, compare_to=IDLE_PROBE),
        ),
        api_keys=(("flood", flood_key), ("probe", probe_key)),
    )


def build_peer_workloads(*, quick: bool = False) -> list[PeerWorkload]:
    """The workloads served by Pagoda and the peers: bursts (all requests at t=0) for every
    peer, and issue 15's mixed burst and trickle for llama-server."""
    count = _scaled(64, quick, 16)
    short = PeerWorkload(
        name="burst-short",
        title=f"{count}-request burst, short prompts, 64 new tokens each",
        workload=_workload(num_requests=count, prompt_repeats=(32,), max_new_tokens=64),
        peer_max_requests={
            PEER_LLAMA: count,
            PEER_GENERATE: 4 if quick else 16,
            PEER_STATIC: count,
            PEER_CONTINUOUS: count,
        },
    )
    if quick:
        return [short]
    mixed = PeerWorkload(
        name="burst-mixed",
        title="32-request burst, prompts of 256 and 32 tokens, 32 new tokens each",
        workload=_workload(num_requests=32, prompt_repeats=(256, 32, 32, 32), max_new_tokens=32),
        peer_max_requests={PEER_LLAMA: 32, PEER_GENERATE: 8, PEER_STATIC: 32, PEER_CONTINUOUS: 32},
    )
    long_mixed = PeerWorkload(
        name="burst-512-mix",
        title="64-request burst, prompts cycling 512/8/8/8 tokens, 32 new tokens each",
        workload=_workload(num_requests=64, prompt_repeats=(512, 8, 8, 8), max_new_tokens=32),
        peer_max_requests={PEER_LLAMA: 64},
        llama_parallel=LLAMA_PARALLEL_MIXED,
    )
    trickle = PeerWorkload(
        name="trickle-short",
        title="32 requests, one every 250 ms, 32-token prompts, 32 new tokens each",
        workload=_workload(
            num_requests=32,
            arrival="interval",
            interval_ms=250,
            prompt_repeats=(32,),
            max_new_tokens=32,
        ),
        peer_max_requests={PEER_LLAMA: 32},
    )
    return [short, mixed, long_mixed, trickle]


def with_target(workload: BenchConfig, target: str) -> BenchConfig:
    return dataclasses.replace(workload, target=target)
