"""Reconciliation on a real ledger: every kind of disagreement is reported with the field
that differs; agreement, and what a cancel legitimately leaves behind, are not."""
from __future__ import annotations

from services.meter.reconcile import reconcile
from services.meter.usage import Mismatch, UsageQuery
from tests.unit.meter.conftest import event
from tokenserve.usage import Source

ENGINE = Source.ENGINE


def run(ledger, start=None, end=None):
    return reconcile(ledger.requests_finished_in(UsageQuery(start=start, end=end)))


def test_reports_every_mismatch_with_its_field_and_counts_the_matches(ledger):
    ledger.record([
        event("g1", request_id="ok"), event("e1", request_id="ok", source=ENGINE),
        event("g2", request_id="no-engine", completion_tokens=4),
        event("e3", request_id="no-gateway", source=ENGINE, completion_tokens=6),
        event("g4", request_id="diff", prompt_tokens=10, completion_tokens=5),
        event("e4", request_id="diff", source=ENGINE, prompt_tokens=11, completion_tokens=3),
        event("g5", request_id="version", model_version="v1"),
        event("e5", request_id="version", source=ENGINE, model_version="v2"),
    ])
    result = run(ledger)
    assert result.matched == 1
    assert result.mismatches == (
        Mismatch("diff", "mismatch", "prompt_tokens", "10", "11"),
        Mismatch("diff", "mismatch", "completion_tokens", "5", "3"),
        Mismatch("no-engine", "missing_engine"),
        Mismatch("no-gateway", "missing_gateway"),
        Mismatch("version", "mismatch", "model_version", "v1", "v2"),
    )
    assert result.drift() == {"mismatch": 3, "missing_engine": 1, "missing_gateway": 1}


def test_engine_records_of_one_request_are_summed_without_failed_attempts(ledger):
    # A retry before the first token leaves an empty or a failed record on the first engine.
    ledger.record([
        event("g", request_id="r", prompt_tokens=10, completion_tokens=5),
        event("e-a", request_id="r", source=ENGINE, prompt_tokens=0, completion_tokens=0),
        event("e-b", request_id="r", source=ENGINE, prompt_tokens=10, completion_tokens=5),
        event("e-c", request_id="r", source=ENGINE, prompt_tokens=10, completion_tokens=0,
              finish_reason="error", status="UNAVAILABLE"),
    ])
    result = run(ledger)
    assert (result.matched, result.mismatches) == (1, ())


def test_a_cancelled_request_may_have_computed_tokens_the_gateway_never_received(ledger):
    ledger.record([
        event("g1", request_id="cut", completion_tokens=3, cached_tokens=0, cancelled=True,
              status="CANCELLED"),
        event("e1", request_id="cut", source=ENGINE, completion_tokens=5, cached_tokens=4,
              cancelled=True, finish_reason="cancelled"),
        event("g2", request_id="short", completion_tokens=6, cancelled=True),
        event("e2", request_id="short", source=ENGINE, completion_tokens=5, cancelled=True),
    ])
    result = run(ledger)
    assert result.matched == 1
    assert result.mismatches == (Mismatch("short", "mismatch", "completion_tokens", "6", "5"),)


def test_window_selects_requests_and_joins_records_just_outside_it(ledger):
    ledger.record([event("old", request_id="old", finished_at=10),
                   event("new", request_id="new", finished_at=2000),
                   event("edge-g", request_id="edge", finished_at=1000.5),
                   event("edge-e", request_id="edge", source=ENGINE, finished_at=999.5)])
    result = run(ledger, 1000, 3000)
    assert result.matched == 1  # "edge": its engine record finished before the window
    assert [m.request_id for m in result.mismatches] == ["new"]
