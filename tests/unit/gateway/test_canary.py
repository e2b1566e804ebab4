"""The canary guard's judgement and the guardian's rollback trigger (fake clock, fake
rollback)."""
from __future__ import annotations

import asyncio

from controlplane.schema import CanaryGuard, Route
from services.gateway.canary import CanaryGuardian, breach
from services.gateway.version_stats import VersionStats, VersionView
from tests.unit.gateway.fake_clock import FakeClock
from tests.unit.gateway.snapshots import MODEL, build

GUARD = CanaryGuard("v2", "v1", max_error_rate=0.1, max_ttft_p99_seconds=2.0,
                    window_seconds=60, min_requests=10)


def view(version, requests, errors=0, ttft=0.5):
    return VersionView(MODEL, version, 60, requests, errors, ttft, None, None)


def test_no_judgement_before_the_minimum_sample():
    assert breach(GUARD, view("v2", 9, errors=9), view("v1", 100)) is None


def test_an_error_rate_over_the_limit_and_over_the_stables_is_a_breach():
    reason = breach(GUARD, view("v2", 20, errors=10), view("v1", 100, errors=1))
    assert reason == ("canary v2 broke its guard over 60s (20 requests):"
                      " error rate 0.50 > 0.1 (stable v1: 0.01)")


def test_a_fault_both_versions_share_is_not_the_canarys():
    assert breach(GUARD, view("v2", 20, errors=4), view("v1", 100, errors=30)) is None
    # ... unless the stable version has too few requests to compare with.
    assert "stable v1: too few requests" in breach(GUARD, view("v2", 20, errors=4),
                                                   view("v1", 3, errors=3))


def test_a_slow_canary_breaks_the_ttft_limit():
    reason = breach(GUARD, view("v2", 20, ttft=3.5), view("v1", 50, ttft=0.4))
    assert "ttft p99 3.500s > 2s (stable v1: 0.400s)" in reason
    assert breach(GUARD, view("v2", 20, ttft=3.5), view("v1", 50, ttft=4.0)) is None


def snapshot(guard):
    return build(routes=[Route(MODEL, {"v1": 50, "v2": 50}, canary=guard)])


async def test_the_guardian_rolls_back_once_per_breach_judging_only_since_the_guard():
    clock = FakeClock()
    stats = VersionStats(clock=clock)
    calls = []

    async def rollback(model, version, reason):
        calls.append((model, version, reason))
        return 42

    guardian = CanaryGuardian(stats, rollback, check_interval=0.5, clock=clock)
    for _ in range(30):  # an earlier canary of v2 failed: not this guard's business
        stats.record(MODEL, "v2", ok=False)
    clock.advance(1)
    snap = snapshot(GUARD)
    guardian.observe(snap, MODEL)
    clock.advance(1)
    for _ in range(10):
        stats.record(MODEL, "v2", ok=True, ttft_s=0.1)
        stats.record(MODEL, "v1", ok=True, ttft_s=0.1)
    guardian.observe(snap, MODEL)
    await asyncio.sleep(0)
    assert calls == []
    for _ in range(10):
        stats.record(MODEL, "v2", ok=False)
    guardian.observe(snap, MODEL)  # checked 0 s ago: waits for the interval
    clock.advance(0.5)
    guardian.observe(snap, MODEL)
    guardian.observe(snap, MODEL)
    clock.advance(0.5)
    guardian.observe(snap, MODEL)  # the rollback is in flight: the watch will show it
    await asyncio.sleep(0)
    assert [(m, v) for m, v, _ in calls] == [(MODEL, "v2")]
    assert "error rate 0.50 > 0.1" in calls[0][2]
    # The same guard written again before this gateway saw the rollback: judged afresh.
    clock.advance(2.0)
    guardian.observe(snap, MODEL)
    clock.advance(1.0)
    for _ in range(10):
        stats.record(MODEL, "v2", ok=True, ttft_s=0.1)
    guardian.observe(snap, MODEL)
    await asyncio.sleep(0)
    assert len(calls) == 1
    # Rolled back: the route has no guard any more, nothing to do.
    guardian.observe(build(routes=[Route(MODEL, {"v1": 100, "v2": 0})]), MODEL)
    await guardian.close()
    assert len(calls) == 1
