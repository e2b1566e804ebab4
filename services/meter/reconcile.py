"""Joins the gateway's and the engines' records of each request and lists disagreements.

Both records describe the same request, so they must agree on who ran what and how many
tokens it used. Two rules follow from how a stream ends:

- A request split over several records of one source is compared on the sums, leaving out
  an engine's failed attempt (finish reason "error") when another engine served the request:
  the gateway retried elsewhere before the first token and billed only the attempt that ran.
- When the request was cancelled (either side says so), the engine may have computed tokens
  the gateway never received, and the gateway never saw the engine's final counts: the
  engine's completion tokens must be >= the gateway's, and cached tokens are not compared.
"""
from __future__ import annotations

from itertools import groupby
from typing import Iterable

from services.meter.usage import Mismatch, Reconciliation
from tokenserve.usage import Source, UsageRecord

# Compared exactly: the labels both sources know, then the counts.
LABELS = ("tenant_id", "model", "model_version")
COUNTS = ("prompt_tokens", "completion_tokens", "cached_tokens")


def _merge(records: list[UsageRecord]) -> dict | None:
    if not records:
        return None
    served = [r for r in records if r.finish_reason != "error"]
    records = served or records
    first = records[0]
    merged = {name: getattr(first, name) for name in LABELS}
    for name in COUNTS:
        merged[name] = sum(getattr(r, name) for r in records)
    merged["cancelled"] = any(r.cancelled for r in records)
    return merged


def compare(request_id: str, gateway: list[UsageRecord],
            engine: list[UsageRecord]) -> list[Mismatch]:
    gw, en = _merge(gateway), _merge(engine)
    if en is None:
        return [Mismatch(request_id, "missing_engine")]
    if gw is None:
        return [Mismatch(request_id, "missing_gateway")]
    cancelled = gw["cancelled"] or en["cancelled"]
    out = []
    for name in (*LABELS, *COUNTS):
        g, e = gw[name], en[name]
        if cancelled and name == "cached_tokens":
            continue
        if cancelled and name == "completion_tokens":
            same = e >= g
        else:
            same = g == e
        if not same:
            out.append(Mismatch(request_id, "mismatch", name, str(g), str(e)))
    return out


def reconcile(records: Iterable[UsageRecord]) -> Reconciliation:
    """`records`: every record of the requests in question, ordered by request id.
    Requests are reported in request-id order."""
    matched, mismatches = 0, []
    for request_id, group in groupby(records, key=lambda r: r.request_id):
        group = list(group)
        found = compare(request_id, [r for r in group if r.source is Source.GATEWAY],
                        [r for r in group if r.source is Source.ENGINE])
        mismatches.extend(found)
        matched += not found
    return Reconciliation(matched=matched, mismatches=tuple(mismatches))
