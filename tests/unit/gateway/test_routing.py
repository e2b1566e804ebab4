"""Model -> version -> engine choice over real snapshots."""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
from structlog.testing import capture_logs

from controlplane.schema import EngineRegistration, ModelSpec, ModelVersion, Route
from services.gateway.affinity import AffinityPolicy, PrefixAffinity
from services.gateway.config import StaticEngine
from services.gateway.health import EjectionPolicy, Failure, ReplicaHealth
from services.gateway.routing import Router, load_factor
from tests.unit.gateway.fake_clock import FakeClock
from tests.unit.gateway.snapshots import MODEL, build
from tokenserve.runtime.errors import NotFound, Unavailable


def router(static=()):
    return Router(static, default_model=MODEL, rng=random.Random(7))


def test_weights_split_traffic_between_versions_with_engines():
    snap = build(routes=[Route(MODEL, {"v1": 3, "v2": 1})],
                 engines=[("v1", "h:1"), ("v2", "h:2")])
    r = router()
    counts = Counter(r.choose(snap, MODEL).version for _ in range(4000))
    assert 2700 < counts["v1"] < 3300 and counts["v1"] + counts["v2"] == 4000


def test_a_version_without_engines_or_weight_gets_nothing():
    snap = build(routes=[Route(MODEL, {"v1": 1, "v2": 0})],
                 engines=[("v1", "h:1"), ("v2", "h:2")])
    assert {router().choose(snap, MODEL).version for _ in range(50)} == {"v1"}
    snap = build(routes=[Route(MODEL, {"v1": 1, "v2": 1})], engines=[("v2", "h:2")])
    assert {router().choose(snap, MODEL).version for _ in range(50)} == {"v2"}


def test_least_outstanding_tokens_wins_and_release_restores():
    snap = build(engines=[("v1", "h:1"), ("v1", "h:2")])
    r = router()
    r.acquire("h:1", 100)
    assert r.choose(snap, MODEL).endpoint == "h:2"
    r.acquire("h:2", 150)
    assert r.choose(snap, MODEL).endpoint == "h:1"
    r.release("h:2", 150)
    assert r.outstanding("h:2") == 0
    assert r.choose(snap, MODEL).endpoint == "h:2"


def test_excluded_endpoints_are_skipped_and_none_left_is_unavailable():
    snap = build(engines=[("v1", "h:1"), ("v1", "h:2")])
    r = router()
    assert r.choose(snap, MODEL, exclude=frozenset({"h:1"})).endpoint == "h:2"
    with pytest.raises(Unavailable, match=MODEL):
        r.choose(snap, MODEL, exclude=frozenset({"h:1", "h:2"}))


def test_static_engines_serve_without_registrations():
    r = router([StaticEngine(MODEL, "v1", "h:9"), StaticEngine("other", "x", "h:8")])
    snap = build(engines=[])
    assert r.choose(snap, MODEL).endpoint == "h:9"
    target = r.choose(snap, "other")  # no route: any version with an engine
    assert (target.version, target.endpoint) == ("x", "h:8")


def test_sticky_routes_keep_a_tenant_on_one_version():
    snap = build(routes=[Route(MODEL, {"v1": 1, "v2": 1}, sticky=True)],
                 engines=[("v1", "h:1"), ("v2", "h:2")])
    r = router()
    for tenant in ("a", "b", "c", "d"):
        assert len({r.choose(snap, MODEL, tenant_id=tenant).version for _ in range(20)}) == 1


def test_unknown_model_is_not_found_and_lists_the_models():
    r = router()
    with pytest.raises(NotFound, match=f"available models: {MODEL}"):
        r.resolve_model(build(), "gpt-9")
    assert r.resolve_model(build(), "") == MODEL


def test_model_listing_shows_route_weights_and_context():
    (info,) = router().models(build(routes=[Route(MODEL, {"v1": 3, "v2": 1})], max_context=64))
    assert (info.name, info.versions, info.max_context) == (MODEL, (("v1", 3), ("v2", 1)), 64)


@pytest.mark.parametrize("configured, engine, expected", [
    (64, 0, 64),      # an engine that reports nothing: the control plane's figure
    (64, 48, 48),     # the engine loaded a shorter model than etcd says: the engine's
    (64, 2048, 64),   # etcd is stricter: etcd's
])
def test_the_context_limit_is_the_smaller_of_etcd_and_the_engines(configured, engine, expected):
    snap = build(engines=[("v1", "h:1")], max_context=configured, engine_max_context=engine)
    assert router().max_context(snap, MODEL) == expected


def _v2_context(snap, v2: int, revision: int = 2):
    """`snap` with etcd's max_context of v2 changed (v1, the default, stays)."""
    v1 = snap.models[MODEL].versions["v1"]
    spec = ModelSpec(MODEL, {"v1": v1, "v2": ModelVersion("builtin:tiny", v2)}, "v1")
    return snap.with_changes(revision, {spec.key: spec})


def test_an_engine_of_a_version_with_a_smaller_etcd_context_bounds_the_model():
    snap = _v2_context(build(engines=[("v1", "h:1"), ("v2", "h:2")], max_context=64), 32)
    assert router().max_context(snap, MODEL) == 32
    assert router().max_context(_v2_context(build(engines=[("v1", "h:1")]), 32), MODEL) == 64


def _mismatches(logs):
    return [{k: v for k, v in e.items() if k not in ("component", "log_level")}
            for e in logs if e["event"] == "engine_context_mismatch"]


def test_a_context_mismatch_is_logged_once_per_engine_when_both_figures_are_known():
    r = router()
    start = build(engines=[("v1", "h:1")], max_context=64, engine_max_context=48)
    with capture_logs() as logs:
        r.log_context_mismatches(start)
        r.log_context_mismatches(start.with_changes(2, {}))  # an unrelated change
    assert _mismatches(logs) == [
        {"event": "engine_context_mismatch", "model": MODEL, "version": "v1",
         "engine": "engine-0", "etcd_max_context": 64, "engine_max_context": 48, "using": 48}]
    assert logs[0]["log_level"] == "warning"

    # A new engine registers (etcd stricter than it), then etcd's v2 figure changes.
    joined = start.with_changes(3, {"engines/engine-1": EngineRegistration(
        "engine-1", "h:2", MODEL, "v2", 8, max_context=4096)})
    with capture_logs() as logs:
        r.log_context_mismatches(joined)
        r.log_context_mismatches(_v2_context(joined, 2048, revision=4))
    assert [(m["engine"], m["version"], m["etcd_max_context"], m["engine_max_context"],
             m["using"]) for m in _mismatches(logs)] == [
        ("engine-1", "v2", 64, 4096, 64), ("engine-1", "v2", 2048, 4096, 2048)]


@pytest.mark.parametrize("configured, engine", [(64, 64), (64, 0)])
def test_no_mismatch_is_logged_when_the_figures_agree_or_the_engine_reports_none(
        configured, engine):
    with capture_logs() as logs:
        router().log_context_mismatches(
            build(engines=[("v1", "h:1")], max_context=configured, engine_max_context=engine))
    assert _mismatches(logs) == []


def test_an_engine_that_registers_again_is_logged_again():
    r = router()
    snap = build(engines=[("v1", "h:1")], max_context=64, engine_max_context=48)
    with capture_logs() as logs:
        r.log_context_mismatches(snap)
        r.log_context_mismatches(snap.with_changes(2, {"engines/engine-0": None}))
        r.log_context_mismatches(snap.with_changes(3, {}))
    assert [m["engine"] for m in _mismatches(logs)] == ["engine-0", "engine-0"]


# -- load, health, affinity, sessions ---------------------------------------------------------

@dataclass
class FakeLoad:
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 100


def test_load_factor_is_one_plus_the_queue_over_the_free_kv_share():
    assert load_factor(None) == 1.0
    assert load_factor(FakeLoad()) == 1.0
    assert load_factor(FakeLoad(waiting=3)) == 4.0
    assert load_factor(FakeLoad(kv_blocks_used=50)) == pytest.approx(2.0)
    assert load_factor(FakeLoad(waiting=1, kv_blocks_used=75)) == pytest.approx(8.0)
    # A full cache (or a report over the total) counts as 95% full, not as infinite load.
    assert load_factor(FakeLoad(kv_blocks_used=120)) == pytest.approx(20.0)
    assert load_factor(FakeLoad(kv_blocks_used=10, kv_blocks_total=0)) == 1.0


def test_the_engines_queue_weighs_on_this_gateways_outstanding_tokens():
    snap = build(engines=[("v1", "h:1"), ("v1", "h:2")])
    loads = {"h:1": FakeLoad(waiting=4), "h:2": FakeLoad()}
    r = Router((), default_model=MODEL, load_of=loads.get)
    # Other gateways' work queued on h:1: this gateway prefers h:2 although it sent it more.
    r.acquire("h:2", 2)
    assert (r.score("h:1"), r.score("h:2")) == (5.0, 3.0)
    assert r.choose(snap, MODEL).endpoint == "h:2"
    # Until what it sent h:2 outweighs h:1's queue.
    r.acquire("h:2", 198)
    assert r.choose(snap, MODEL).endpoint == "h:1"
    # A replica the load board knows nothing about counts its outstanding tokens only.
    loads.clear()
    r.release("h:2", 200)
    r.acquire("h:1", 1)
    assert r.choose(snap, MODEL).endpoint == "h:2"


def test_a_nearly_full_kv_cache_steers_requests_away():
    snap = build(engines=[("v1", "h:1"), ("v1", "h:2")])
    loads = {"h:1": FakeLoad(kv_blocks_used=90), "h:2": FakeLoad(kv_blocks_used=10)}
    r = Router((), default_model=MODEL, load_of=loads.get)
    r.acquire("h:2", 5)  # (5 + 1) / 0.9 < (0 + 1) / 0.1
    assert r.choose(snap, MODEL).endpoint == "h:2"


def test_ejected_replicas_get_no_requests_until_a_probe_says_serving():
    clock = FakeClock()
    health = ReplicaHealth(EjectionPolicy(failures=1), clock=clock)
    snap = build(engines=[("v1", "h:1"), ("v1", "h:2")])
    r = Router((), default_model=MODEL, health=health)
    health.on_failure("h:1", Failure.UNAVAILABLE)
    assert {r.choose(snap, MODEL).endpoint for _ in range(5)} == {"h:2"}
    clock.advance(1.0)
    assert health.due_probes() == ["h:1"]
    health.on_probe("h:1", serving=True)
    assert r.choose(snap, MODEL).endpoint == "h:1"


def test_when_every_replica_is_ejected_they_are_tried_anyway():
    health = ReplicaHealth(EjectionPolicy(failures=1), clock=FakeClock())
    snap = build(routes=[Route(MODEL, {"v1": 1, "v2": 1})], engines=[("v1", "h:1"), ("v2", "h:2")])
    r = Router((), default_model=MODEL, health=health)
    health.on_failure("h:1", Failure.UNAVAILABLE)
    # v1's only replica is out: v2 takes the traffic rather than a refusal.
    assert {r.choose(snap, MODEL).version for _ in range(20)} == {"v2"}
    health.on_failure("h:2", Failure.UNAVAILABLE)
    assert {r.choose(snap, MODEL).version for _ in range(40)} == {"v1", "v2"}


def test_prefix_affinity_returns_a_repeated_prefix_to_its_replica():
    snap = build(engines=[("v1", "h:1"), ("v1", "h:2")])
    r = Router((), default_model=MODEL, affinity=PrefixAffinity())
    system = list(range(100, 164))  # four full 16-token blocks
    first = r.choose(snap, MODEL, tenant_id="acme", prompt_ids=system + [1, 2, 3]).endpoint
    r.acquire(first, 300)  # busier than the other, but not much busier
    again = r.choose(snap, MODEL, tenant_id="acme", prompt_ids=system + [7, 8, 9]).endpoint
    assert again == first
    # Another tenant's identical prompt and an unrelated prompt go by load.
    other = next(ep for ep in ("h:1", "h:2") if ep != first)
    assert r.choose(snap, MODEL, tenant_id="beta", prompt_ids=system).endpoint == other
    assert r.choose(snap, MODEL, tenant_id="acme", prompt_ids=list(range(64))).endpoint == other


def test_prefix_affinity_gives_way_when_its_replica_is_much_busier():
    snap = build(engines=[("v1", "h:1"), ("v1", "h:2")])
    r = Router((), default_model=MODEL,
               affinity=PrefixAffinity(AffinityPolicy(slack=2.0, balance_tokens=1000)))
    prompt = list(range(48))
    first = r.choose(snap, MODEL, prompt_ids=prompt).endpoint
    other = next(ep for ep in ("h:1", "h:2") if ep != first)
    r.acquire(first, 1000)  # score 1001 <= max(2 x 1, 1 + 1000)
    assert r.choose(snap, MODEL, prompt_ids=prompt).endpoint == first
    r.acquire(first, 1)  # score 1002: much busier
    assert r.choose(snap, MODEL, prompt_ids=prompt).endpoint == other
    # ... and the prefix now lives with the replica that served it last.
    r.release(first, 1001)
    r.acquire(other, 500)
    assert r.choose(snap, MODEL, prompt_ids=prompt).endpoint == other


def test_a_session_key_keeps_a_conversation_on_one_version_without_sticky_routes():
    snap = build(routes=[Route(MODEL, {"v1": 50, "v2": 50})],
                 engines=[("v1", "h:1"), ("v2", "h:2")])
    r = router()
    seen = {}
    for session in (f"s{i}" for i in range(40)):
        versions = {r.choose(snap, MODEL, tenant_id="acme", session_id=session).version
                    for _ in range(10)}
        assert len(versions) == 1
        seen[session] = versions.pop()
    assert set(seen.values()) == {"v1", "v2"}  # sessions still spread by weight
    # The same session id of another tenant is another conversation.
    assert any(r.choose(snap, MODEL, tenant_id="beta", session_id=s).version != v
               for s, v in seen.items())
