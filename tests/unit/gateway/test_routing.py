"""Model -> version -> engine choice over real snapshots."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from controlplane.schema import Route
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
