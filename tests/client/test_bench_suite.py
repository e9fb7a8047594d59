"""make bench: scenario definitions, options, the peers' result conversion, the tables.

No model is loaded and no process is started here.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.peers import (
    PeerRun,
    _completion_length,
    make_step_timer,
    request_result_from_token_times,
)
from benchmarks.scenarios import ALL_PEERS, PEER_LLAMA, build_peer_workloads, build_scenarios
from benchmarks.suite import _print_probe_goal, main, parse_args, select, target_columns
from benchmarks.suite_report import SuiteResults, compare_variants, peer_verdict, relative_change
from pagoda.client.bench_config import BenchConfig
from pagoda.client.bench_report import format_report_table, summarize

# -- scenarios ------------------------------------------------------------------------------


@pytest.mark.parametrize("quick", [False, True])
def test_scenarios_are_well_formed(quick):
    scenarios = build_scenarios(quick=quick, salt="s")
    names = [s.name for s in scenarios]
    assert names and len(set(names)) == len(names)
    for scenario in scenarios:
        labels = [v.label for v in scenario.variants]
        labels += [label for v in scenario.variants for label, _ in v.alongside]
        assert len(labels) >= 2 and len(set(labels)) == len(labels)
        assert set(scenario.baselines) == set(labels)
        assert set(scenario.baselines.values()) <= set(labels)
        # Workloads alongside run as other tenants: the scenario names each one's key.
        keys = {key for _, key in scenario.api_keys}
        for variant in scenario.variants:
            if variant.alongside:
                assert variant.workload.api_key in keys
                assert {w.api_key for _, w in variant.alongside} <= keys - {
                    variant.workload.api_key
                }
        # A comparison changes knobs, not the workload: each baseline has its variant's.
        by_label = {v.label: v for v in scenario.variants}
        for variant in scenario.variants:
            assert by_label[scenario.baselines[variant.label]].workload == variant.workload
            assert variant.workload.ignore_eos


def test_two_tenants_compare_each_tenant_with_itself_fair_share_off():
    scenario = next(s for s in build_scenarios(salt="zq7") if s.name == "two-tenants")
    assert scenario.baselines == {
        "off: probe": "off: probe",
        "off: flood": "off: flood",
        "on: probe": "off: probe",
        "on: flood": "off: flood",
        "idle: probe": "idle: probe",
    }
    assert all("zq7" in key for _, key in scenario.api_keys)  # unique to the run


def test_every_scenario_flag_is_a_valid_scheduler_setting():
    from pagoda.scheduler_svc import settings

    for scenario in build_scenarios():
        for variant in scenario.variants:
            loaded, _ = settings.load(list(variant.scheduler_args), environ={})
            assert loaded.config.scheduler is not None


def test_quick_is_a_smaller_subset():
    full = {s.name: s for s in build_scenarios()}
    quick = build_scenarios(quick=True)
    assert 0 < len(quick) < len(full)
    for scenario in quick:
        full_requests = sum(v.workload.num_requests for v in full[scenario.name].variants)
        assert sum(v.workload.num_requests for v in scenario.variants) < full_requests


def test_shared_system_prompt_is_salted_per_run():
    def prefixes(salt):
        scenario = next(s for s in build_scenarios(salt=salt) if s.name == "prefix-caching")
        return {v.workload.shared_prefix for v in scenario.variants} - {None}

    assert prefixes("a") != prefixes("b")


@pytest.mark.parametrize("quick", [False, True])
def test_peer_workloads_give_each_peer_what_it_can_serve(quick):
    workloads = build_peer_workloads(quick=quick)
    assert workloads[0].name == "burst-short"
    assert set(workloads[0].peer_max_requests) == set(ALL_PEERS)
    for workload in workloads:
        assert workload.workload.ignore_eos and workload.peer_max_requests
        assert set(workload.peer_max_requests) <= set(ALL_PEERS)
        # The transformers peers serve a burst at t=0; only llama-server honours arrivals.
        if workload.workload.arrival != "burst":
            assert set(workload.peer_max_requests) == {PEER_LLAMA}
        assert all(
            0 < n <= workload.workload.num_requests for n in workload.peer_max_requests.values()
        )
    if not quick:
        assert workloads[0].workload.num_requests == 64
        assert workloads[0].workload.max_new_tokens == 64


# -- options --------------------------------------------------------------------------------


def test_parse_args_defaults_and_repeatable_only():
    args = parse_args([])
    assert (args.quick, args.only, args.device, args.worker_model) == (
        False,
        None,
        "auto",
        "default",
    )
    args = parse_args(["--quick", "--only", "a", "--only", "b", "--device", "cpu", "--json", "x"])
    assert args.quick and args.only == ["a", "b"] and args.device == "cpu" and args.json == "x"


def test_select_filters_and_rejects_unknown_names():
    scenarios, workloads = build_scenarios(), build_peer_workloads()
    assert select(scenarios, workloads, None) == (scenarios, workloads)
    kept, kept_workloads = select(scenarios, workloads, ["prefix-caching", "burst-short"])
    assert [s.name for s in kept] == ["prefix-caching"]
    assert [w.name for w in kept_workloads] == ["burst-short"]
    with pytest.raises(ValueError, match="nope"):
        select(scenarios, workloads, ["nope"])


def test_list_prints_names_and_starts_nothing(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "prefill-budget" in out and "burst-short" in out


def test_unknown_only_is_a_usage_error(capsys):
    assert main(["--only", "nope"]) == 2
    assert "unknown" in capsys.readouterr().err


def test_target_columns_run_each_distinct_workload_once():
    prefix = next(s for s in build_scenarios() if s.name == "prefix-caching")
    columns = target_columns(prefix)
    assert len(columns) == 2
    assert all("server's own knobs" in label for label, _ in columns)
    assert columns[0][0].startswith("same, off / same, on")


# -- peers ----------------------------------------------------------------------------------


def test_request_result_from_token_times():
    result = request_result_from_token_times(3, [0.5, 0.6, 0.8], end_s=0.85, num_prompt_tokens=7)
    assert result.ok and result.index == 3 and result.send_s == 0.0
    assert result.ttft_s == pytest.approx(0.5)
    assert result.itls_s == pytest.approx([0.1, 0.2])
    assert result.tpot_s == pytest.approx(0.15)
    assert result.e2e_s == pytest.approx(0.85)
    assert result.usage.prompt_tokens == 7 and result.usage.completion_tokens == 3
    # end_s is never before the last token
    assert request_result_from_token_times(0, [1.0], end_s=0.5, num_prompt_tokens=1).end_s == 1.0


def test_peer_results_summarize_like_pagoda_runs():
    config = BenchConfig(num_requests=2, max_new_tokens=2, ignore_eos=True)
    results = [
        request_result_from_token_times(0, [0.1, 0.2], 0.2, 5),
        request_result_from_token_times(1, [0.3, 0.4], 0.4, 5),
    ]
    report = summarize(config, "t", results, duration_s=0.4, num_preemptions=None)
    assert report.num_ok == 2 and report.num_completion_tokens == 4
    assert report.completion_tokens_per_s == pytest.approx(10.0)
    assert report.ttft.p50_ms == pytest.approx(200.0)
    assert report.num_prompt_tokens == 10
    assert PeerRun(report, 2).note is None
    assert PeerRun(report, 8).note == "first 2 of 8 requests only"


def test_step_timer_skips_the_prompt_and_times_each_step():
    timer = make_step_timer()
    timer.put([[1, 2, 3]])
    assert timer.step_times_s == []
    timer.put([4])
    timer.put([5])
    timer.end()
    assert len(timer.step_times_s) == 2 and timer.step_times_s[0] <= timer.step_times_s[1]


def test_completion_length_stops_at_the_first_eos():
    assert _completion_length([5, 6, 2, 2, 2], {2}) == 3
    assert _completion_length([5, 6, 7], {2}) == 3
    assert _completion_length([2, 2], set()) == 2


# -- tables and sentences -------------------------------------------------------------------


def _report(ttft_s: float, gap_s: float, num_tokens: int = 4, num_requests: int = 2):
    results = [
        request_result_from_token_times(
            i, [ttft_s + k * gap_s for k in range(num_tokens)], ttft_s + num_tokens * gap_s, 8
        )
        for i in range(num_requests)
    ]
    duration_s = ttft_s + num_tokens * gap_s
    config = BenchConfig(num_requests=num_requests, max_new_tokens=num_tokens, ignore_eos=True)
    return summarize(config, "t", results, duration_s, None)


def test_compare_variants_against_each_baseline():
    runs = {"a": _report(1.0, 0.1), "b": _report(0.5, 0.1), "c": _report(2.0, 0.1)}
    lines = compare_variants(runs, {"a": "a", "b": "a", "c": "c"})
    assert len(lines) == 1 and lines[0].startswith("b vs a: TTFT p50 -50.0% (1000 -> 500 ms)")
    assert "completion tok/s x" in lines[0]
    assert relative_change(None, 1.0) is None and relative_change(0.0, 1.0) is None


def test_peer_verdict_names_the_best_peer_and_the_target():
    pagoda = _report(0.1, 0.01)
    peers = {"slow": _report(1.0, 0.1), "fast": _report(0.5, 0.05)}
    lines = peer_verdict(pagoda, peers)
    assert "best peer (fast" in lines[0] and lines[0].endswith("met")
    assert "lowest peer's 500 ms (fast)" in lines[1] and lines[1].endswith("lower")
    missed = peer_verdict(_report(0.5, 0.05), {"same": _report(0.5, 0.05)})
    assert missed[0].endswith("MISSED") and missed[1].endswith("NOT lower")


def test_tables_and_json_of_a_suite():
    results = SuiteResults()
    results.scenarios["x"] = {"fifo": _report(1.0, 0.1), "pack": _report(0.5, 0.1)}
    results.scheduler_args["x"] = {"fifo": [], "pack": ["--admission-policy", "pack"]}
    results.peer_workloads["w"] = {
        "pagoda": _report(0.1, 0.01),
        "hf generate() [1 req]": _report(1, 1, 4, 1),
    }
    results.peer_notes["w"] = {"hf generate() [1 req]": "first 1 of 2 requests only"}
    table = format_report_table(results.peer_workloads["w"])
    assert "hf generate() [1 req]" in table.splitlines()[0]
    assert "1/1" in table and "2/2" in table
    document = json.loads(json.dumps(results.to_dict()))
    assert document["scenarios"]["x"]["scheduler_args"]["pack"] == ["--admission-policy", "pack"]
    assert document["scenarios"]["x"]["runs"]["pack"]["num_ok"] == 2
    assert document["peer_workloads"]["w"]["notes"]["hf generate() [1 req]"].startswith("first")


def test_the_probe_goal_is_twice_its_idle_ttft_plus_a_flood_step(capsys):
    runs = {
        "idle: probe": _report(ttft_s=0.08, gap_s=0.03),
        "on: probe": _report(ttft_s=0.2, gap_s=0.06),
        "on: flood": _report(ttft_s=1.0, gap_s=0.07),
    }
    _print_probe_goal(runs)
    line = capsys.readouterr().out
    assert "fair share on: 200 ms; goal 230 ms" in line  # 2 x 80 + 70
    _print_probe_goal({k: v for k, v in runs.items() if k != "idle: probe"})
    assert capsys.readouterr().out == ""  # another scenario's runs: nothing to say
