"""Joins the gateway's and the engines' records of each request and lists disagreements."""
from __future__ import annotations

from services.meter.store import Ledger
from services.meter.usage import Mismatch, Reconciliation, Source, UsageQuery


def reconcile(ledger: Ledger, start: float | None, end: float | None) -> Reconciliation:
    """Every request with a record of either source finished in [start, end).

    A request whose engine side is split over several events (a retry before the first
    token) is compared on the sums. Requests are reported in request-id order.
    """
    totals = ledger.totals_by_request(UsageQuery(start=start, end=end))
    request_ids = sorted({rid for rid, _ in totals})
    matched, mismatches = 0, []
    for rid in request_ids:
        gw = totals.get((rid, Source.GATEWAY.value))
        en = totals.get((rid, Source.ENGINE.value))
        if en is None:
            mismatches.append(Mismatch(rid, "missing_engine", gateway_value=gw[1]))
            continue
        if gw is None:
            mismatches.append(Mismatch(rid, "missing_gateway", engine_value=en[1]))
            continue
        found = False
        for i, kind in enumerate(("prompt_tokens", "completion_tokens")):
            if gw[i] != en[i]:
                mismatches.append(Mismatch(rid, kind, gateway_value=gw[i], engine_value=en[i]))
                found = True
        matched += not found
    return Reconciliation(matched=matched, mismatches=tuple(mismatches))
