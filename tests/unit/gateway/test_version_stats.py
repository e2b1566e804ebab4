"""The gateway's per-version window: error rate, TTFT p99, added latency."""
from __future__ import annotations

import pytest

from services.gateway.version_stats import VersionStats, counts_as_error, percentile
from tests.unit.gateway.fake_clock import FakeClock


def test_error_rate_and_latencies_over_the_window():
    clock = FakeClock()
    stats = VersionStats(clock=clock)
    for i in range(100):
        stats.record("m", "v1", ok=True, ttft_s=0.1 + i / 1000, added_s=0.002)
    for _ in range(25):
        stats.record("m", "v1", ok=False)
    v = stats.view("m", "v1", window_seconds=60)
    assert (v.requests, v.errors) == (125, 25)
    assert v.error_rate == pytest.approx(0.2)
    assert v.ttft_p99_s == pytest.approx(0.198)  # failures have no TTFT
    assert v.added_latency_p50_s == v.added_latency_p99_s == 0.002


def test_samples_leave_the_window_as_time_passes():
    clock = FakeClock()
    stats = VersionStats(retain_seconds=120, clock=clock)
    stats.record("m", "v2", ok=False)
    clock.advance(30)
    stats.record("m", "v2", ok=True, ttft_s=0.5)
    assert stats.view("m", "v2", window_seconds=60).error_rate == 0.5
    clock.advance(31)
    v = stats.view("m", "v2", window_seconds=60)
    assert (v.requests, v.errors, v.ttft_p99_s) == (1, 0, 0.5)
    clock.advance(200)
    assert stats.view("m", "v2").requests == 0 and stats.view("m", "v2").ttft_p99_s is None
    assert stats.versions() == []


def test_versions_are_kept_apart_and_unknown_ones_are_empty():
    stats = VersionStats(clock=FakeClock())
    stats.record("m", "v1", ok=True, ttft_s=0.1)
    stats.record("m", "v2", ok=False)
    assert stats.view("m", "v1").error_rate == 0.0 and stats.view("m", "v2").error_rate == 1.0
    assert stats.view("other", "v1").requests == 0
    assert stats.versions() == [("m", "v1"), ("m", "v2")]


def test_which_outcomes_count_against_a_version():
    assert counts_as_error("OK") is False
    assert counts_as_error("UNAVAILABLE") and counts_as_error("INTERNAL")
    assert counts_as_error("DEADLINE_EXCEEDED")
    for code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "CANCELLED", "FAILED_PRECONDITION"):
        assert counts_as_error(code) is None


def test_percentile_is_nearest_rank():
    assert percentile([], 0.99) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0
    assert percentile([float(i) for i in range(1, 101)], 0.5) == 50.0
