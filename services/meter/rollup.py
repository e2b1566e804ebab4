"""The hourly rollup: per-hour sums of the ledger, kept in the transaction that stores the
events, so that a month of a tenant is ~700 rows per label set instead of every event.

One rollup row per (source, tenant, hour, app, model, version, tier). Token, energy and
event sums are exact by construction: only events stored for the first time are added
(a duplicate event id adds nothing, a refused batch never reaches the ledger).

Requests are harder: QueryUsage counts distinct request ids per group, and a request whose
records (of one source) fall under two rollup keys (an engine retry on another version, a
request id a client reused, two records either side of an hour) would be counted once per
key. So a request is counted in the rollup only while all its records share one key; when
a record under a second key arrives it is taken out again and listed in
`usage_split_requests`, and a query adds those few requests back from the raw events.

Plain logic here (keys, hours, the deltas of one batch); the SQL is in store.py (writes)
and queries.py (reads).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from services.meter.usage import GroupBy, UsageQuery
from tokenserve.usage import Source, UsageRecord

HOUR = 3600
# Rollup key: the primary key of usage_hourly, in its column order.
KEY_COLUMNS = ("source", "tenant_id", "hour", "app", "model", "model_version", "tier")
# Summed columns of usage_hourly (energy_estimated is a MAX).
SUM_COLUMNS = ("events", "requests", "prompt_tokens", "completion_tokens", "cached_tokens",
               "energy_joules", "energy_estimated")
Key = tuple  # (source, tenant_id, hour, app, model, model_version, tier)
RequestRef = tuple  # (source, request_id)


def floor_to(t: float, seconds: int) -> int:
    """The start of t's bucket (t >= 0). Exact: a t below a boundary is at least one ulp
    below it, which divided by `seconds` is more than half an ulp of the quotient, so the
    correctly rounded t / seconds never reaches the next integer. store.bucket_sql is the
    same computation in SQL."""
    return int(t / seconds) * seconds


def key_of(source: str, tenant_id: str, app: str, model: str, model_version: str, tier: str,
           finished_at: float) -> Key:
    return (source, tenant_id, floor_to(finished_at, HOUR), app, model, model_version, tier)


def ceil_to(t: float, seconds: int) -> int:
    start = floor_to(t, seconds)
    return start if start == t else start + seconds


@dataclass(frozen=True)
class Plan:
    """How the rollup answers a query: whole hours [start_hour, end_hour) (None: unbounded)
    from the rollup, the parts of an hour at either end of the range from the events."""

    start_hour: int | None
    end_hour: int | None
    edges: tuple[tuple[float, float], ...]


def plan(q: UsageQuery) -> Plan | None:
    """None where the rollup cannot help: a time bucket that is not whole hours, or a range
    without a whole hour in it (its events are few anyway)."""
    if GroupBy.TIME in q.group_by and q.bucket_seconds % HOUR:
        return None
    lo = None if q.start is None else ceil_to(q.start, HOUR)
    hi = None if q.end is None else floor_to(q.end, HOUR)
    if lo is not None and hi is not None and lo >= hi:
        return None
    edges = []
    if q.start is not None and q.start < lo:
        edges.append((q.start, float(lo)))
    if q.end is not None and hi < q.end:
        edges.append((float(hi), q.end))
    return Plan(lo, hi, tuple(edges))


@dataclass(slots=True)
class Sums:
    events: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    energy_joules: float = 0.0
    energy_estimated: int = 0

    def values(self) -> tuple:
        """In SUM_COLUMNS order."""
        return (self.events, self.requests, self.prompt_tokens, self.completion_tokens,
                self.cached_tokens, self.energy_joules, self.energy_estimated)


@dataclass(frozen=True)
class Delta:
    """What one batch changes: rollup rows to add to, split requests with their hour span."""

    sums: dict[Key, Sums]
    splits: dict[RequestRef, tuple[int, int]]  # -> (first hour, last hour) of its records


SOURCE_TEXT = {s: s.value for s in Source}


def delta(new: Iterable[UsageRecord], before: Mapping[RequestRef, set[Key]],
          split: set[RequestRef]) -> Delta:
    """`new`: events stored for the first time in this batch. `before`: the keys of the
    records each of their requests already had (absent: none; not needed for a split one);
    `split`: those of their requests already listed as split."""
    # The ingest hot path: one pass per event with no calls but floor_to; the usual request
    # (new, one record) then costs one more dict entry and an increment.
    sums: dict[Key, Sums] = {}
    first: dict[RequestRef, tuple[Key, Sums]] = {}
    more: dict[RequestRef, set[Key]] = {}  # requests with records under several keys here
    for e in new:
        source = SOURCE_TEXT[e.source]
        k = (source, e.tenant_id, floor_to(e.finished_at, HOUR), e.app, e.model,
             e.model_version, e.tier)
        s = sums.get(k)
        if s is None:
            s = sums[k] = Sums()
        s.events += 1
        s.prompt_tokens += e.prompt_tokens
        s.completion_tokens += e.completion_tokens
        s.cached_tokens += e.cached_tokens
        s.energy_joules += e.energy_joules
        if e.energy_estimated:
            s.energy_estimated = 1
        ref = (source, e.request_id)
        seen = first.get(ref)
        if seen is None:
            first[ref] = (k, s)
        elif seen[0] != k:
            more.setdefault(ref, {seen[0]}).add(k)
    splits = {}
    for ref, (k, s) in first.items():
        had = before.get(ref)
        if ref not in split and ref not in more:
            if not had:  # a new request, under one key
                s.requests += 1
                continue
            if len(had) == 1 and k in had:
                continue  # another record under the key it has
        had = had or set()
        if ref not in split and len(had) == 1:  # it was under one key: take it out there
            (old,) = had
            (sums.get(old) or sums.setdefault(old, Sums())).requests -= 1
        hours = [key[2] for key in more.get(ref, {k}) | had]
        splits[ref] = (min(hours), max(hours))
    return Delta(sums, splits)
