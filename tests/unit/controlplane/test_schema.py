"""Schema validation: every rule names the key, the field and the limit."""
from __future__ import annotations

import json

import pytest

from controlplane import schema
from controlplane.schema import (ApiKey, Degradation, DegradationThresholds, ModelSpec, ModelVersion,
                                 Route, Tenant, Tier, generate_api_key, hash_api_key, parse)
from controlplane.seed import default_documents
from tokenserve.runtime.errors import InvalidArgument


def tier(**kw) -> Tier:
    args = dict(name="free", requests_per_second=10, tokens_per_minute=20_000, daily_tokens=1_000_000,
                max_concurrency=4, priority=0, max_tokens=512)
    return Tier(**{**args, **kw})


def test_tier_negative_rate_names_field_and_rule():
    with pytest.raises(InvalidArgument) as e:
        tier(requests_per_second=-1)
    assert str(e.value) == "tiers/free: requests_per_second must be > 0, got -1"


@pytest.mark.parametrize("field,value,needle", [
    ("tokens_per_minute", 0, "tokens_per_minute must be > 0, got 0"),
    ("max_concurrency", 2.5, "max_concurrency must be an integer, got 2.5"),
    ("priority", -1, "priority must be >= 0, got -1"),
    ("max_tokens", True, "max_tokens must be an integer, got True"),
    ("requests_per_second", float("inf"), "requests_per_second must be a finite number"),
    ("name", "bad/name", "name must be 1-128 chars"),
])
def test_tier_rules(field, value, needle):
    with pytest.raises(InvalidArgument, match=needle.replace("(", r"\(").replace(".", r"\.")):
        tier(**{field: value})


def test_tenant_overrides_only_tier_limits_and_apply():
    with pytest.raises(InvalidArgument, match=r"tenants/acme: overrides.bogus is not a tier limit"):
        Tenant("acme", "Acme", "free", overrides={"bogus": 1})
    with pytest.raises(InvalidArgument, match=r"overrides.requests_per_second must be > 0"):
        Tenant("acme", "Acme", "free", overrides={"requests_per_second": 0})
    t = Tenant("acme", "Acme", "free", overrides={"requests_per_second": 99})
    eff = t.effective(tier())
    assert eff.requests_per_second == 99 and eff.tokens_per_minute == 20_000
    with pytest.raises(TypeError):
        t.overrides["max_tokens"] = 1  # frozen


def test_api_key_generation_stores_only_the_hash():
    key, record = generate_api_key("acme")
    assert key.startswith("ts-") and len(key) > 40
    assert record.key_hash == hash_api_key(key) and len(record.key_hash) == 64
    assert record.display_prefix == key[:10]
    assert key not in schema.encode(record).decode()
    other, _ = generate_api_key("acme")
    assert other != key


def test_api_key_rejects_non_hash():
    with pytest.raises(InvalidArgument, match="key_hash must be 64 lowercase hex"):
        ApiKey("ts-plaintext", "acme", "ts-1234567", "2026-01-01T00:00:00Z")


def test_degradation_rules():
    th = DegradationThresholds(queue_depth=10, ttft_p99_seconds=2.0, kv_use_fraction=0.9,
                               power_watts_vs_budget=1.0)
    with pytest.raises(InvalidArgument, match=r"degradation: ladder.free: unknown action 'drop'"):
        Degradation(th, {"free": ["queue", "drop"]})
    with pytest.raises(InvalidArgument, match=r"kv_use_fraction must be <= 1, got 1.5"):
        Degradation(DegradationThresholds(10, 2.0, 1.5, 1.0), {})
    d = Degradation(th, {"free": ["queue", "reject"]})
    assert [d.action("free", n) for n in range(4)] == [None, "queue", "reject", "reject"]
    assert d.action("premium", 3) is None


def test_route_and_model_rules():
    with pytest.raises(InvalidArgument, match="at least one weight must be > 0"):
        Route("m", {"a": 0})
    with pytest.raises(InvalidArgument, match=r"versions.a must be >= 0, got -5"):
        Route("m", {"a": -5, "b": 10})
    with pytest.raises(InvalidArgument, match=r"default_version 'v9' is not one of the versions"):
        ModelSpec("m", {"v1": ModelVersion("/x", 2048)}, "v9")


def test_parse_round_trip_and_errors():
    for doc in default_documents():
        assert parse(doc.key, schema.encode(doc)) == doc
    with pytest.raises(InvalidArgument, match="not a config key"):
        parse("nope/x", b"{}")
    with pytest.raises(InvalidArgument, match=r"tiers/free: unknown field\(s\) colour"):
        parse("tiers/free", json.dumps({**schema.to_dict(tier()), "colour": "red"}))
    with pytest.raises(InvalidArgument, match=r"tiers/free: missing required field\(s\)"):
        parse("tiers/free", b'{"requests_per_second": 3}')
    with pytest.raises(InvalidArgument, match="does not match the key"):
        parse("tiers/gold", schema.encode(tier()))
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        parse("tiers/free", b"{nope")
    with pytest.raises(InvalidArgument, match=r"engines/e1: endpoint must be host:port"):
        parse("engines/e1", b'{"endpoint": "nohost", "model": "m", "version": "v", "capacity": 1}')


def test_a_route_without_a_canary_guard_encodes_as_before():
    old = b'{"model":"m","sticky":false,"versions":{"a":90,"b":10}}'
    route = parse("routes/m", old)
    assert route.canary is None
    assert schema.encode(route) == old  # services that predate the guard can still read it


def test_canary_guard_round_trip_and_rules():
    guard = schema.CanaryGuard("b", "a", max_error_rate=0.1, window_seconds=30, min_requests=5)
    route = Route("m", {"a": 90, "b": 10}, canary=guard)
    assert parse(route.key, schema.encode(route)) == route
    assert schema.to_dict(route)["canary"]["max_ttft_p99_seconds"] is None
    assert guard.describe() == "b: error rate <= 0.1 over 30s (min 5 requests), else back to a"

    def bad(match, **kw):
        args = dict(version="b", stable="a", max_error_rate=0.1)
        with pytest.raises(InvalidArgument, match=match):
            Route("m", {"a": 90, "b": 10}, canary=schema.CanaryGuard(**{**args, **kw}))

    bad("give max_error_rate, max_ttft_p99_seconds or both", max_error_rate=None)
    bad(r"canary.max_error_rate must be < 1, got 1.5", max_error_rate=1.5)
    bad(r"canary.max_ttft_p99_seconds must be > 0", max_ttft_p99_seconds=0)
    bad(r"canary.stable must differ", stable="b")
    bad(r"canary.stable 'c' is not one of the versions \(a, b\)", stable="c")
    bad(r"canary.window_seconds must be <= 600", window_seconds=3600)
    bad(r"canary.min_requests must be >= 1", min_requests=0)
    with pytest.raises(InvalidArgument, match=r"routes/m: unknown field 'colour'"):
        parse("routes/m", json.dumps({"model": "m", "versions": {"a": 1, "b": 1}, "canary": {
            "version": "b", "stable": "a", "max_error_rate": 0.1, "colour": "red"}}))
