"""Tenants at the edge (issue 27 item 1): key file lines, derived names, the trusted header."""

from __future__ import annotations

import hashlib

import pytest

from pagoda.scheduler_svc import settings
from pagoda.scheduler_svc.auth import (
    read_api_keys,
    read_key_entries,
    resolve_tenant_quotas,
    tenant_directory,
)
from pagoda.scheduler_svc.core import ConfigError
from pagoda.scheduler_svc.tenants import (
    DEFAULT_TENANT,
    TENANT_HEADER,
    Tenant,
    TenantDirectory,
    TokenBucket,
    derived_name,
    parse_key_file,
    parse_key_line,
)


def test_a_bare_key_is_a_tenant_named_by_its_digest_never_the_key():
    entry = parse_key_line("s3cret-key")
    assert entry.key == "s3cret-key"
    digest = hashlib.sha256(b"s3cret-key").hexdigest()
    assert entry.tenant == Tenant(f"key-{digest[:8]}", 1.0)
    assert "s3cret" not in entry.tenant.name
    assert derived_name("s3cret-key") == entry.tenant.name


def test_name_weight_key_lines_give_a_name_and_a_weight():
    assert parse_key_line("alice:2:k-a") == parse_key_line("alice:2.0:k-a")
    entry = parse_key_line("alice:2:k:with:colons")
    assert entry.key == "k:with:colons" and entry.tenant == Tenant("alice", 2.0)
    # Not the form (bad weight, bad name): the whole line is a key, as before.
    for line in ("alice:0:k", "alice:-1:k", "alice:x:k", "a b:1:k", "alice:1:"):
        assert parse_key_line(line).key == line


def test_plain_key_files_keep_working_and_mixed_files_parse(tmp_path):
    path = tmp_path / "keys"
    path.write_text("key-a\n\n# tenant b\nbob:3:key-b  \n")
    assert read_api_keys(str(path)) == ["key-a", "key-b"]
    tenants = [entry.tenant for entry in read_key_entries(str(path))]
    assert tenants == [Tenant(derived_name("key-a")), Tenant("bob", 3.0)]


def test_a_key_or_a_name_twice_is_refused():
    with pytest.raises(ConfigError, match="holds a key twice"):
        parse_key_file("k\nk\n")
    with pytest.raises(ConfigError, match="names tenant bob twice"):
        parse_key_file("bob:1:k1\nbob:2:k2\n")


def test_the_tenant_is_the_key_that_authenticated_the_call():
    directory = TenantDirectory(parse_key_file("alice:2:ka\nkb\n"))
    assert directory.tenant_of([("authorization", "Bearer ka")]) == Tenant("alice", 2.0)
    assert directory.tenant_of([("authorization", "Bearer kb")]).name == derived_name("kb")
    # The header is not trusted by default: a caller cannot pose as another tenant.
    posing = [("authorization", "Bearer kb"), (TENANT_HEADER, "alice")]
    assert directory.tenant_of(posing).name == derived_name("kb")


def test_without_keys_the_deployment_is_one_tenant():
    assert TenantDirectory([]).tenant_of([]) == Tenant(DEFAULT_TENANT)
    assert TenantDirectory([]).tenant_of([(TENANT_HEADER, "x")]) == Tenant(DEFAULT_TENANT)


def test_a_trusted_front_names_the_tenant():
    directory = TenantDirectory(parse_key_file("alice:2:ka\n"), trust_header=True)
    assert directory.tenant_of([(TENANT_HEADER, "carol")]) == Tenant("carol", 1.0)
    assert directory.tenant_of([(TENANT_HEADER, b"alice")]) == Tenant("alice", 2.0)
    with pytest.raises(ValueError, match=TENANT_HEADER):
        directory.tenant_of([(TENANT_HEADER, "bad name\n")])


def test_trust_tenant_header_setting(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("alice:2:ka\n")
    loaded, _ = settings.load(["--trust-tenant-header", "--api-key-file", str(keys)], {})
    directory = tenant_directory(loaded.config)
    assert directory.tenant_of([(TENANT_HEADER, "alice")]) == Tenant("alice", 2.0)
    assert not settings.load([], {"PAGODA_TRUST_TENANT_HEADER": "0"})[0].config.trust_tenant_header


def test_the_token_bucket_lets_a_minutes_worth_through_then_refills_evenly():
    bucket = TokenBucket(600, now=0.0)  # 10 tokens a second
    assert bucket.take(400, 0.0) is None
    assert bucket.take(200, 0.0) is None
    assert bucket.take(50, 0.0) == pytest.approx(5.0)  # 50 tokens: 5 s to refill
    assert bucket.take(50, 5.0) is None
    # A request larger than a minute's worth waits for a full bucket, never for ever.
    assert bucket.take(6000, 10.0) == pytest.approx(55.0)
    assert bucket.take(6000, 70.0) is None
    assert bucket.take(1, 70.0) is not None  # in debt: it refills first


def test_with_several_keys_one_tenant_cannot_fill_the_waiting_queue(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("ka\nkb\n")
    config = settings.load(["--api-key-file", str(keys), "--max-waiting-requests", "100"], {})[0]
    assert resolve_tenant_quotas(config.config).scheduler.max_tenant_waiting_requests == 50
    explicit = settings.load(
        ["--api-key-file", str(keys), "--max-tenant-waiting-requests", "7"], {}
    )[0].config
    assert resolve_tenant_quotas(explicit).scheduler.max_tenant_waiting_requests == 7
    keys.write_text("ka\n")  # one tenant: the whole queue is its own
    config = settings.load(["--api-key-file", str(keys)], {})[0].config
    assert resolve_tenant_quotas(config).scheduler.max_tenant_waiting_requests is None
    toml = tmp_path / "pagoda.toml"
    toml.write_text("max_tenant_requests = 9\ntenant_tokens_per_minute = 1000\n")
    config = settings.load(["--config", str(toml)], {"PAGODA_MAX_TENANT_REQUESTS": "8"})[0]
    assert config.config.scheduler.max_tenant_requests == 8  # env wins over TOML
    assert config.config.tenant_tokens_per_minute == 1000
    with pytest.raises(ConfigError, match="tenant_tokens_per_minute must be >= 1"):
        settings.load(["--tenant-tokens-per-minute", "0"], {})


def test_metrics_carry_each_tenants_figures_and_ttft_by_name():
    from prometheus_client import generate_latest

    from pagoda.scheduler_svc.core import FinishReason, RequestOutput, TenantStats, Timings, Usage
    from pagoda.scheduler_svc.metrics import Metrics

    metrics = Metrics()
    metrics.watch_tenants(lambda: [TenantStats("alice", 1, 2, 30, 4, 5)])
    output = RequestOutput(
        request_id="r",
        text="",
        token_ids=[],
        logprobs=None,
        finish_reason=FinishReason.STOP,
        usage=Usage(
            prompt_tokens=3, completion_tokens=2, cached_prompt_tokens=0, num_preemptions=0
        ),
        timings=Timings(queued_ms=1.0, first_token_ms=40.0, total_ms=90.0),
    )
    metrics.observe_tenant_finish("alice", output)
    text = generate_latest(metrics.registry).decode()
    assert 'pagoda_tenant_requests_waiting{tenant="alice"} 1.0' in text
    assert 'pagoda_tenant_served_tokens{tenant="alice"} 30.0' in text
    assert 'pagoda_tenant_preemptions{tenant="alice"} 4.0' in text
    assert 'pagoda_tenant_time_to_first_token_seconds_count{tenant="alice"} 1.0' in text
    bounds, counts, total_s = metrics.tenant_ttft("alice")
    assert bounds[-1] == float("inf") and counts[-1] == 1 and total_s == pytest.approx(0.04)
    assert metrics.tenant_ttft("bob") == ([], [], 0.0)
