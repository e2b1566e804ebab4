"""tsctl top's arithmetic over Prometheus text: rates and percentiles between two scrapes."""
from __future__ import annotations

import pytest

from controlplane.top import engine_row, gateway_row, histogram_quantile, kind_of, parse_samples

ENGINE_BEFORE = """
tokenserve_engine_generated_tokens_total 100.0
tokenserve_engine_time_to_first_token_seconds_bucket{le="0.1"} 2.0
tokenserve_engine_time_to_first_token_seconds_bucket{le="0.5"} 4.0
tokenserve_engine_time_to_first_token_seconds_bucket{le="+Inf"} 4.0
tokenserve_engine_running_requests 0.0
tokenserve_engine_waiting_requests 0.0
tokenserve_engine_kv_blocks_used 0.0
tokenserve_engine_kv_blocks_free 100.0
"""
ENGINE_AFTER = """
tokenserve_engine_generated_tokens_total 150.0
tokenserve_engine_time_to_first_token_seconds_bucket{le="0.1"} 2.0
tokenserve_engine_time_to_first_token_seconds_bucket{le="0.5"} 4.0
tokenserve_engine_time_to_first_token_seconds_bucket{le="+Inf"} 8.0
tokenserve_engine_running_requests 3.0
tokenserve_engine_waiting_requests 2.0
tokenserve_engine_kv_blocks_used 25.0
tokenserve_engine_kv_blocks_free 75.0
"""


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = {0.1: 50.0, 0.5: 100.0, float("inf"): 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None
    # everything above the last finite bound: the bound (Prometheus does the same)
    assert histogram_quantile(0.99, {0.1: 0.0, float("inf"): 4.0}) == 0.1


def test_engine_row_takes_rates_and_percentiles_over_the_interval():
    row = engine_row("h:9103", parse_samples(ENGINE_BEFORE), parse_samples(ENGINE_AFTER), 2.0)
    assert row.tokens_per_s == 25.0
    assert (row.ttft_window, row.itl_window) == ("interval", "start")
    # the 4 new observations all fell above 0.5 s: the interval's p50 is 0.5, not the since-start one
    assert row.ttft_p50_s == 0.5
    assert (row.running, row.waiting, row.kv_used_fraction) == (3, 2, 0.25)


def test_with_no_new_observation_percentiles_are_since_start():
    same = parse_samples(ENGINE_BEFORE)
    row = engine_row("h:9103", same, same, 1.0)
    assert row.tokens_per_s == 0 and row.ttft_window == "start"
    assert row.ttft_p50_s == pytest.approx(0.1)


def test_gateway_row_counts_rejections_by_tier():
    text = """
tokenserve_gateway_requests_total{method="Generate",tier="free",code="RESOURCE_EXHAUSTED"} 7.0
tokenserve_gateway_requests_total{method="Chat",tier="free",code="RESOURCE_EXHAUSTED"} 1.0
tokenserve_gateway_requests_total{method="Generate",tier="premium",code="OK"} 5.0
tokenserve_gateway_usage_spool_events 3.0
"""
    before = parse_samples(text.replace(" 5.0", " 1.0"))
    row = gateway_row("h:9101", before, parse_samples(text), 2.0)
    assert row.rejections_by_tier == {"free": 8}
    assert row.requests_per_s == 2.0
    assert row.spool_events == 3 and row.degradation_level is None
    assert kind_of(parse_samples(text)) == "gateway" and kind_of(parse_samples(ENGINE_AFTER)) == "engine"


def test_engines_sharing_a_host_are_matched_only_when_named():
    from controlplane.top import EngineRow, match, pair

    rows = [EngineRow(metrics="h:9103"), EngineRow(metrics="h:9203")]
    assert match(rows, "h:50053", pair(["h:9103", "h:9203"])) is None  # ambiguous: not guessed
    paired = pair(["h:50053=h:9103", "h:9203"])
    assert match(rows, "h:50053", paired) is rows[0]
    assert match(rows[:1], "other:50053", pair(["h:9103"])) is None
    assert match(rows[1:], "h:60053", pair(["h:9203"])) is rows[1]  # the only one on its host
