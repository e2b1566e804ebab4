"""Reconciliation on a real ledger: every kind of mismatch is reported, agreement is not."""
from __future__ import annotations

from services.meter.reconcile import reconcile
from services.meter.usage import Mismatch, Source
from tests.unit.meter.conftest import event

ENGINE = Source.ENGINE


def test_reports_every_mismatch_and_counts_the_matches(ledger):
    ledger.record([
        event("g1", request_id="ok"), event("e1", request_id="ok", source=ENGINE),
        event("g2", request_id="no-engine", completion_tokens=4),
        event("e3", request_id="no-gateway", source=ENGINE, completion_tokens=6),
        event("g4", request_id="diff", prompt_tokens=10, completion_tokens=5),
        event("e4", request_id="diff", source=ENGINE, prompt_tokens=11, completion_tokens=3),
    ])
    result = reconcile(ledger, None, None)
    assert result.matched == 1
    assert result.mismatches == (
        Mismatch("diff", "prompt_tokens", gateway_value=10, engine_value=11),
        Mismatch("diff", "completion_tokens", gateway_value=5, engine_value=3),
        Mismatch("no-engine", "missing_engine", gateway_value=4),
        Mismatch("no-gateway", "missing_gateway", engine_value=6),
    )


def test_engine_records_of_one_request_are_summed(ledger):
    # A retry before the first token leaves an empty record on the first engine.
    ledger.record([
        event("g", request_id="r", prompt_tokens=10, completion_tokens=5),
        event("e-a", request_id="r", source=ENGINE, prompt_tokens=0, completion_tokens=0),
        event("e-b", request_id="r", source=ENGINE, prompt_tokens=10, completion_tokens=5),
    ])
    result = reconcile(ledger, None, None)
    assert (result.matched, result.mismatches) == (1, ())


def test_window_limits_the_requests_considered(ledger):
    ledger.record([event("old", request_id="old", finished_at=10),
                   event("new", request_id="new", finished_at=2000)])
    result = reconcile(ledger, 1000, 3000)
    assert [m.request_id for m in result.mismatches] == ["new"]
