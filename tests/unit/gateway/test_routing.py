"""Model -> version -> engine choice over real snapshots."""
from __future__ import annotations

import random
from collections import Counter

import pytest
from structlog.testing import capture_logs

from controlplane.schema import EngineRegistration, ModelSpec, ModelVersion, Route
from services.gateway.config import StaticEngine
from services.gateway.routing import Router
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
