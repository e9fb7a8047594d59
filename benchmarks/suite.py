"""`make bench`: Pagoda's scheduler knobs compared on fixed workloads, then Pagoda vs peers.

    .venv/bin/python -m benchmarks.suite            # everything, about 8 minutes on 2 cores
    .venv/bin/python -m benchmarks.suite --quick    # a 2-minute subset
    .venv/bin/python -m benchmarks.suite --list     # scenario and peer-workload names
    .venv/bin/python -m benchmarks.suite --only prefix-caching --no-peers --json out.json
    .venv/bin/python -m benchmarks.suite --only trickle-short --peer llama-server
    .venv/bin/python -m benchmarks.suite --only burst-short \
        --peer openai:pagoda-front=http://127.0.0.1:8000   # any OpenAI-compatible server
    BENCH_TARGET=host:port .venv/bin/python -m benchmarks.suite   # an already running server
    .venv/bin/python -m benchmarks.suite --device cuda --write-docs  # on a GPU host

Without BENCH_TARGET the suite starts a worker and, per knob setting, a scheduler (see
benchmarks.suite_service), runs the load generator for every variant of every scenario and
the peer workloads, stops the service, then runs llama.cpp's llama-server when `make
llama-server` has built it (see benchmarks.llama_server) and the `transformers` peers in this
process on the same prompts (see benchmarks.peers), one at a time, so they never compete for
the cores. `--peer openai[:LABEL]=URL` adds any OpenAI-compatible server already running
(vLLM, llama-server, Pagoda's own pagoda-openai; see benchmarks.openai_peer), driven
through /v1/completions on each peer workload; `--peer llama-server-openai` runs the
llama-server peer through that same client instead of its native /completion. With
BENCH_TARGET it cannot change the server's knobs: each distinct workload runs once against
the server as it is configured, and the tables say so.

--device is the worker's and the peers' (both synchronize before they read a clock).
--write-docs copies everything the run printed into its own generated section of
docs/benchmarks.md ("make bench --device cuda", say; see benchmarks.docs_section), which a
re-run replaces.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import secrets
import signal
import sys
import threading
import time

from benchmarks.docs_section import section_body, write_section
from benchmarks.openai_peer import API_KEY_ENV, PEER_OPENAI, OpenAIPeer, parse_peer
from benchmarks.scenarios import (
    ALL_PEERS,
    FLOOD_WITH_PROBE,
    IDLE_PROBE,
    KNOWN_PEERS,
    PEER_KEYS,
    PEER_LLAMA,
    PEER_LLAMA_OPENAI,
    PEERS,
    PROBE_UNDER_FLOOD,
    PeerWorkload,
    Scenario,
    Variant,
    build_peer_workloads,
    build_scenarios,
    with_target,
)
from benchmarks.suite_report import SuiteResults, compare_variants, peer_verdict, plot_cdfs
from benchmarks.suite_service import LocalService, resolve_model_dir
from benchmarks.tenants import ttft_goal_ms
from pagoda.client.bench import run_bench
from pagoda.client.bench_config import BenchConfig
from pagoda.client.bench_report import BenchReport, format_report_table

PAGODA = "pagoda"
TARGET_NOTE = "server's own knobs"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.suite",
        description="Pagoda's benchmark suite (make bench): scheduler knobs on fixed workloads, "
        "then Pagoda vs transformers peers. BENCH_TARGET=host:port benchmarks a running "
        "server instead of starting one (its knobs then stay as they are).",
    )
    parser.add_argument("--quick", action="store_true", help="a ~2-minute subset")
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run only this scenario or peer workload (repeatable; see --list)",
    )
    parser.add_argument("--list", action="store_true", help="list the names and exit")
    parser.add_argument("--no-peers", action="store_true", help="skip every peer")
    parser.add_argument(
        "--peer",
        action="append",
        type=peer_argument,
        metavar="PEER",
        help=f"run only this peer (repeatable; default: all but llama-server-openai, "
        f"llama-server when built): {', '.join(PEER_KEYS)}, or an OpenAI-compatible server "
        "already running, openai=URL or openai:LABEL=URL (its key from $OPENAI_API_KEY)",
    )
    parser.add_argument(
        "--device", default="auto", help="worker and peer device: auto, cpu, cuda, cuda:N"
    )
    parser.add_argument("--json", metavar="PATH", help="write every result as JSON")
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="copy the run's output into its own generated section of docs/benchmarks.md "
        '("make bench --device DEVICE"; a quick run gets "make bench-quick ...")',
    )
    parser.add_argument("--plot", metavar="PNG", help="write latency CDFs of one workload")
    # A smoke-test hook: `--worker-model dummy` runs the scenarios without weights.
    parser.add_argument("--worker-model", default="default", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def select(
    scenarios: list[Scenario], workloads: list[PeerWorkload], only: list[str] | None
) -> tuple[list[Scenario], list[PeerWorkload]]:
    """Keep the named ones (all when `only` is empty); ValueError names an unknown name."""
    if not only:
        return scenarios, workloads
    known = [s.name for s in scenarios] + [w.name for w in workloads]
    unknown = [name for name in only if name not in known]
    if unknown:
        raise ValueError(f"unknown name(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [s for s in scenarios if s.name in only], [w for w in workloads if w.name in only]


def peer_argument(text: str) -> str | OpenAIPeer:
    """A --peer value: a PEER_KEYS name, or an OpenAIPeer for openai[:LABEL]=URL."""
    if text in PEER_KEYS:
        return text
    if text.split("=")[0].split(":")[0] == PEER_OPENAI:
        try:
            return parse_peer(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    raise argparse.ArgumentTypeError(
        f"unknown peer {text!r}; known: {', '.join(PEER_KEYS)}, openai=URL, openai:LABEL=URL"
    )


def selected_peers(args: argparse.Namespace) -> tuple[str, ...]:
    """The named peers to run, in KNOWN_PEERS order (ALL_PEERS when --peer is not given)."""
    if args.no_peers:
        return ()
    if not args.peer:
        return ALL_PEERS
    wanted = {PEER_KEYS[key] for key in args.peer if isinstance(key, str)}
    return tuple(peer for peer in KNOWN_PEERS if peer in wanted)


def openai_peers(args: argparse.Namespace) -> list[OpenAIPeer]:
    """The OpenAI-compatible servers given as --peer openai[:LABEL]=URL, in order; ValueError
    when two share a label."""
    if args.no_peers:
        return []
    peers = [peer for peer in args.peer or () if isinstance(peer, OpenAIPeer)]
    labels = [peer.label for peer in peers]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two --peer openai servers share a label ({', '.join(labels)}); "
                         "name each, e.g. openai:vllm=URL")  # fmt: skip
    return peers


def target_columns(scenario: Scenario) -> list[tuple[str, BenchConfig]]:
    """Under BENCH_TARGET: one column per distinct workload, named after its variants."""
    columns: dict[BenchConfig, list[str]] = {}
    for variant in scenario.variants:
        columns.setdefault(variant.workload, []).append(variant.label)
    return [(f"{' / '.join(labels)} ({TARGET_NOTE})", w) for w, labels in columns.items()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    salt = secrets.token_hex(3)
    try:
        scenarios, workloads = select(
            build_scenarios(quick=args.quick, salt=salt),
            build_peer_workloads(quick=args.quick),
            args.only,
        )
        servers = openai_peers(args)
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for item in [*scenarios, *workloads]:
            print(f"{item.name:18} {item.title}")
        for key, peer in PEER_KEYS.items():
            print(f"--peer {key:22} {peer}")
        any_server = f"{PEER_OPENAI}[:LABEL]=URL"
        print(f"--peer {any_server:22} any OpenAI-compatible server, via /v1/completions")
        return 0

    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    transcript = _Tee(sys.stdout) if args.write_docs else None
    if transcript is not None:
        sys.stdout = transcript
    target = os.environ.get("BENCH_TARGET")
    results = SuiteResults()
    started_s = time.perf_counter()
    load_before = os.getloadavg()
    try:
        peers = selected_peers(args) if args.worker_model != "dummy" else ()
        servers = servers if args.worker_model != "dummy" else []
        run_peers = bool(workloads) and (bool(peers) or bool(servers))
        model_dir = resolve_model_dir(args.worker_model) if run_peers or not target else ""
        if target:
            print(f"BENCH_TARGET={target}: the server's knobs cannot be changed; each distinct "
                  "workload runs once against it as configured.")  # fmt: skip
            _run_against_target(target, scenarios, workloads, results)
        else:
            _run_local_service(args, model_dir, scenarios, workloads, results)
        if run_peers:
            if PEER_LLAMA in peers or PEER_LLAMA_OPENAI in peers:
                _run_llama_server(model_dir, args.device, workloads, results, peers)
            _run_openai_peers(model_dir, servers, workloads, results)
            _run_peers(model_dir, args.device, workloads, results, peers)
            _print_peer_tables(workloads, results)
    except KeyboardInterrupt:
        print("\nbench: interrupted; every process it started has been stopped", file=sys.stderr)
        return 130
    wall_s = time.perf_counter() - started_s
    print(f"\nsuite wall time: {wall_s:.0f} s (load average before: {load_before[0]:.2f})")
    if args.json:
        document = {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "target": target,
            "quick": args.quick,
            "device": args.device,
            "cpu_count": os.cpu_count(),
            "load_average_before": load_before,
            "wall_s": wall_s,
            **results.to_dict(),
        }
        with open(args.json, "w") as out:
            json.dump(document, out, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        _plot(results, args.plot)
    if transcript is not None:
        sys.stdout = transcript.stream
        _write_docs(args, transcript.getvalue(), load_before[0])
    return 0


class _Tee(io.StringIO):
    """Keeps a copy of what is printed, for --write-docs."""

    def __init__(self, stream) -> None:
        super().__init__()
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(text)
        return super().write(text)

    def flush(self) -> None:
        self.stream.flush()


def _write_docs(args: argparse.Namespace, transcript: str, load_before: float) -> None:
    device = _peer_device(args.device) if args.device == "auto" else args.device
    name = f"make bench{'-quick' if args.quick else ''} --device {device.split(':')[0]}"
    notes = [f"Device: {_device_name(device)}; {os.cpu_count()} CPUs, load average "
             f"{load_before:.2f} before the run."]  # fmt: skip
    write_section(name, section_body(name, transcript, notes))
    print(f"wrote the section {name!r} of docs/benchmarks.md")


def _device_name(device: str) -> str:
    if not device.startswith("cuda"):
        return "CPU"
    import torch

    return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"


def _run_local_service(
    args: argparse.Namespace,
    model_dir: str,
    scenarios: list[Scenario],
    workloads: list[PeerWorkload],
    results: SuiteResults,
) -> None:
    with LocalService(
        worker_model=args.worker_model, device=args.device, model_dir=model_dir
    ) as service:
        service.start_worker()
        for scenario in scenarios:
            _print_scenario_header(scenario)
            runs: dict[str, BenchReport] = {}
            results.scheduler_args[scenario.name] = {}
            keys = _key_file_args(service, scenario)
            for variant in scenario.variants:
                warm_up_key = variant.workload.api_key
                _use_scheduler(service, (*variant.scheduler_args, *keys), warm_up_key)
                runs.update(_bench_tenants(variant, service.address))
                results.scheduler_args[scenario.name][variant.label] = list(variant.scheduler_args)
            results.scenarios[scenario.name] = runs
            _print_comparison(runs, scenario.baselines)
            _print_shares(scenario, runs)
            _print_probe_goal(runs)
        for workload in workloads:
            _use_scheduler(service, ())
            report = _bench(with_target(workload.workload, service.address))
            results.peer_workloads[workload.name] = {PAGODA: report}


def _use_scheduler(
    service: LocalService, scheduler_args: tuple[str, ...], api_key: str | None = None
) -> None:
    ready_s = service.use_scheduler(scheduler_args)
    if ready_s is not None:
        flags = " ".join(scheduler_args) or "(defaults)"
        print(f"  scheduler {flags}: serving after {ready_s:.1f} s", file=sys.stderr)
        # The first requests after a restart pay one-time costs; keep them out of the runs.
        run_bench(
            BenchConfig(
                target=service.address,
                api_key=api_key,
                num_requests=2,
                prompt_repeats=(8,),
                max_new_tokens=4,
                ignore_eos=True,
            )  # fmt: skip
        )


def _key_file_args(service: LocalService, scenario: Scenario) -> tuple[str, ...]:
    """Scheduler flags for the scenario's API keys (a key file in the run directory)."""
    if not scenario.api_keys:
        return ()
    path = service.run_dir / f"api-keys-{scenario.name}"
    path.write_text("".join(f"{name}:1:{key}\n" for name, key in scenario.api_keys))
    path.chmod(0o600)
    return ("--api-key-file", str(path))


def _bench_tenants(variant: Variant, target: str) -> dict[str, BenchReport]:
    """The variant's workload, and those alongside it at the same time (one thread each)."""
    reports: dict[str, BenchReport] = {}

    def run(label: str, workload: BenchConfig) -> None:
        reports[label] = run_bench(with_target(workload, target))

    threads = [threading.Thread(target=run, args=pair) for pair in variant.alongside]
    for thread in threads:
        thread.start()
    try:
        time.sleep(variant.start_after_s)
        main_report = _bench(with_target(variant.workload, target))
    finally:
        for thread in threads:
            thread.join()
    return {variant.label: main_report, **reports}


def _print_shares(scenario: Scenario, runs: dict[str, BenchReport]) -> None:
    """Each tenant's share of the completion tokens of the runs made together (of the
    requests that finished: those cut at the run's end are not counted)."""
    for variant in scenario.variants:
        labels = [variant.label, *(label for label, _ in variant.alongside)]
        if len(labels) < 2:
            continue
        total = sum(runs[label].num_completion_tokens for label in labels) or 1
        shares = ", ".join(
            f"{label} {runs[label].num_completion_tokens / total:.3f}" for label in labels
        )
        print(f"share of finished requests' completion tokens: {shares}", flush=True)


def _print_probe_goal(runs: dict[str, BenchReport]) -> None:
    """two-tenants: the probe's TTFT p99 under the flood with fair share, against issue
    27's goal: twice its idle TTFT (p50) plus one step, the flood's ITL p50 (one decode
    step of the running set)."""
    idle, probe, flood = (
        runs.get(label) for label in (IDLE_PROBE, PROBE_UNDER_FLOOD, FLOOD_WITH_PROBE)
    )
    if idle is None or probe is None or flood is None:
        return
    if idle.ttft is None or probe.ttft is None or flood.itl is None:
        return
    goal_ms = ttft_goal_ms(idle.ttft.p50_ms, flood.itl.p50_ms)
    print(
        f"probe TTFT p99 under the flood, fair share on: {probe.ttft.p99_ms:.0f} ms; goal "
        f"{goal_ms:.0f} ms (2 x idle p50 {idle.ttft.p50_ms:.0f} ms + a step, the flood's ITL "
        f"p50 {flood.itl.p50_ms:.0f} ms)",
        flush=True,
    )


def _run_against_target(
    target: str,
    scenarios: list[Scenario],
    workloads: list[PeerWorkload],
    results: SuiteResults,
) -> None:
    for scenario in scenarios:
        _print_scenario_header(scenario)
        if scenario.api_keys:
            print("skipped: it needs the server started with its own API keys", flush=True)
            continue
        runs = {label: _bench(with_target(w, target)) for label, w in target_columns(scenario)}
        results.scenarios[scenario.name] = runs
        # Every column ran on the same server settings: there is no knob to compare.
        print(format_report_table(runs), flush=True)
    for workload in workloads:
        runs = {f"{PAGODA} ({TARGET_NOTE})": _bench(with_target(workload.workload, target))}
        results.peer_workloads[workload.name] = runs
        print(f"\n## {workload.name}: {workload.title}")
        print(format_report_table(runs), flush=True)


def _run_llama_server(
    model_dir: str,
    device: str,
    workloads: list[PeerWorkload],
    results: SuiteResults,
    peers: tuple[str, ...] = (PEER_LLAMA,),
) -> None:
    """llama-server on its workloads: PEER_LLAMA through its native /completion,
    PEER_LLAMA_OPENAI through the OpenAI peer's client, each when in `peers`."""
    from benchmarks import llama_server
    from benchmarks.peers import prompt_token_ids

    install = llama_server.installation()
    skip = llama_server.skip_reason(install, _peer_device(device))
    if skip is not None:
        print(f"\n{skip}", file=sys.stderr)
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    apis = [(p, api) for p, api in ((PEER_LLAMA, "native"), (PEER_LLAMA_OPENAI, "openai"))
            if p in peers]  # fmt: skip
    for workload in workloads:
        if PEER_LLAMA not in workload.peer_max_requests:
            continue
        for peer, api in apis:
            print(f"  {workload.name}: {peer} ...", file=sys.stderr)
            run_tag = secrets.token_hex(3)
            ids = prompt_token_ids(tokenizer, workload.workload, run_tag)
            try:
                report = llama_server.run_workload(
                    install, workload.workload, ids, run_tag, parallel=workload.llama_parallel,
                    api=api,
                )  # fmt: skip
            except llama_server.LlamaServerError as exc:
                print(f"  {workload.name}: {peer} failed: {exc}", file=sys.stderr)
                continue
            label = f"{peer} np{workload.llama_parallel}"
            results.peer_workloads.setdefault(workload.name, {})[label] = report


def _run_openai_peers(
    model_dir: str, servers: list[OpenAIPeer], workloads: list[PeerWorkload], results: SuiteResults
) -> None:
    """Each server on every peer workload, the prompts as token ids of the suite's model."""
    if not servers:
        return
    from transformers import AutoTokenizer

    from benchmarks import openai_peer
    from benchmarks.peers import prompt_token_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    api_key = os.environ.get(API_KEY_ENV)
    for workload in workloads:
        for server in servers:
            print(f"  {workload.name}: {server.label} ({server.base_url}) ...", file=sys.stderr)
            run_tag = secrets.token_hex(3)
            ids = prompt_token_ids(tokenizer, workload.workload, run_tag)
            try:
                report = openai_peer.run_workload(
                    server.base_url, workload.workload, ids, run_tag, api_key=api_key
                )
            except (openai_peer.OpenAIPeerError, OSError, ValueError) as exc:
                print(f"  {workload.name}: {server.label} failed: {exc}", file=sys.stderr)
                continue
            results.peer_workloads.setdefault(workload.name, {})[server.label] = report


def _run_peers(
    model_dir: str,
    device: str,
    workloads: list[PeerWorkload],
    results: SuiteResults,
    selected: tuple[str, ...] = PEERS,
) -> None:
    wanted = [w for w in workloads if any(p in w.peer_max_requests for p in PEERS if p in selected)]
    if not wanted:
        return
    import logging

    from benchmarks.peers import Peers

    # generate_batch warns on every call that EOS is disabled, which is what ignore_eos asks.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    print("\nloading the peers' model in this process ...", file=sys.stderr)
    peers = Peers(model_dir, _peer_device(device))
    for workload in wanted:
        runs = results.peer_workloads.setdefault(workload.name, {})
        notes = results.peer_notes.setdefault(workload.name, {})
        for peer in PEERS:
            if peer not in selected or peer not in workload.peer_max_requests:
                continue
            print(f"  {workload.name}: {peer} ...", file=sys.stderr)
            limit = workload.peer_max_requests[peer]
            run = peers.run(peer, workload.workload, secrets.token_hex(3), limit)
            label = peer if run.note is None else f"{peer} [{run.report.num_requests_sent} req]"
            runs[label] = run.report
            if run.note is not None:
                notes[label] = run.note


def _print_peer_tables(workloads: list[PeerWorkload], results: SuiteResults) -> None:
    for workload in workloads:
        runs = results.peer_workloads.get(workload.name, {})
        notes = results.peer_notes.get(workload.name, {})
        if not any(not label.startswith(PAGODA) for label in runs):
            continue
        print(f"\n== peers: {workload.name}: {workload.title}")
        print(format_report_table(runs))
        for label, note in notes.items():
            print(f"note: {label}: {note} (its TTFT/E2E would be longer with the whole burst)")
        pagoda = [label for label in runs if label.startswith(PAGODA)]
        if pagoda:
            peer_runs = {label: r for label, r in runs.items() if label not in pagoda}
            for line in peer_verdict(runs[pagoda[0]], peer_runs):
                print(line)


def _peer_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _bench(config: BenchConfig) -> BenchReport:
    return run_bench(config, progress=sys.stderr if sys.stderr.isatty() else None)


def _print_scenario_header(scenario: Scenario) -> None:
    print(f"\n== {scenario.name}: {scenario.title}")
    print(f"question: {scenario.question}")
    print(f"earlier result: {scenario.seed_result}", flush=True)


def _print_comparison(runs: dict[str, BenchReport], baselines: dict[str, str]) -> None:
    print(format_report_table(runs))
    for line in compare_variants(runs, baselines):
        print(line)
    sys.stdout.flush()


def _plot(results: SuiteResults, path: str) -> None:
    """The peers' burst if it ran (Pagoda and every peer), else the first scenario."""
    if results.peer_workloads:
        name, runs = next(iter(results.peer_workloads.items()))
    elif results.scenarios:
        name, runs = next(iter(results.scenarios.items()))
    else:
        return
    plot_cdfs(runs, path, title=f"{name}: latency CDFs")
    print(f"wrote {path}")


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    raise SystemExit(main())
