"""The hourly rollup on real databases: QueryUsage gives the same rows from the rollup as
from the events, whatever was sent (duplicates, refused batches, requests whose records
fall under several rollup keys), over any range and grouping.

Energies are multiples of 1/4 J, so their sums are exact in either order of addition and
rows compare with ==."""
from __future__ import annotations

import random
import threading

import pytest

from services.meter import rollup
from services.meter.store import Ledger
from services.meter.usage import GroupBy, UsageQuery
from tests.unit.meter.conftest import event
from tokenserve.usage import Source

H = rollup.HOUR
T0 = 1_800_000_000 // H * H  # an hour boundary
ENGINE = Source.ENGINE


def same(ledger, q: UsageQuery):
    """The rows QueryUsage returns, after checking the rollup path gives the raw path's."""
    assert rollup.plan(q) is not None, "the rollup path is not taken for this query"
    got = ledger.query(q)
    assert got == ledger.query(q, from_events=True), q
    return got


def stored_rollup(ledger) -> list[tuple]:
    return ledger._execute("SELECT * FROM usage_hourly ORDER BY 1, 2, 3, 4, 5, 6, 7").fetchall()


def test_duplicates_and_refused_batches_add_nothing_to_the_rollup(ledger):
    ledger.record([event("a", finished_at=T0 + 10), event("b", finished_at=T0 + 20),
                   event("a", finished_at=T0 + 10)])
    ledger.record([event("b", finished_at=T0 + 20, prompt_tokens=99), event("c",
                   finished_at=T0 + H + 5, energy_joules=0.25)])
    before = stored_rollup(ledger)
    # A batch the database refuses part way (NOT NULL) stores nothing, rollup included.
    with pytest.raises(Exception):
        ledger.record([event("d", finished_at=T0 + 30), event("e", tenant_id=None)])
    # Only duplicates: nothing changes.
    assert ledger.record([event("a", finished_at=T0 + 10), event("c", finished_at=T0 + H + 5)
                          ]).accepted == 0
    assert stored_rollup(ledger) == before
    (total,) = same(ledger, UsageQuery())
    assert (total.requests, total.prompt_tokens, total.energy_joules) == (3, 30, 0.25)
    rows = same(ledger, UsageQuery(group_by=(GroupBy.TIME,)))
    assert [(r.keys, r.requests) for r in rows] == [((str(T0),), 2), ((str(T0 + H),), 1)]


def test_a_request_under_several_keys_counts_once_per_group(ledger):
    ledger.record([
        # an engine retry on another version, in two batches (below)
        event("e1", request_id="retry", source=ENGINE, model_version="v1",
              finished_at=T0 + 100, finish_reason="error"),
        # records either side of an hour boundary
        event("e2", request_id="late", source=ENGINE, finished_at=T0 + H - 1),
        event("e3", request_id="late", source=ENGINE, finished_at=T0 + H + 1),
        # the gateway's record of a request is another source: not split
        event("g1", request_id="retry", finished_at=T0 + 200),
        # a request id a client reused, under one key, then under another tenant
        event("g2", request_id="mine", finished_at=T0 + 300),
        event("g3", request_id="mine", finished_at=T0 + 400),
    ])
    ledger.record([event("e4", request_id="retry", source=ENGINE, model_version="v2",
                         finished_at=T0 + 150)])
    ledger.record([event("g4", request_id="mine", tenant_id="t2", finished_at=T0 + 500)])
    (engine,) = same(ledger, UsageQuery(source=ENGINE))
    assert engine.requests == 2
    rows = same(ledger, UsageQuery(source=ENGINE, group_by=(GroupBy.VERSION,)))
    assert [(r.keys, r.requests) for r in rows] == [(("v1",), 2), (("v2",), 1)]
    rows = same(ledger, UsageQuery(source=ENGINE, group_by=(GroupBy.TIME,)))
    assert [(r.keys, r.requests) for r in rows] == [((str(T0),), 2), ((str(T0 + H),), 1)]
    (gateway,) = same(ledger, UsageQuery())
    assert gateway.requests == 2
    rows = same(ledger, UsageQuery(group_by=(GroupBy.TENANT,)))
    assert [(r.keys, r.requests) for r in rows] == [(("t1",), 2), (("t2",), 1)]
    # a range that keeps one side of a split request
    (after,) = same(ledger, UsageQuery(source=ENGINE, start=T0 + H))
    assert (after.requests, after.prompt_tokens) == (1, 10)
    splits = ledger._execute("SELECT source, request_id FROM usage_split_requests"
                             " ORDER BY 2, 1").fetchall()
    assert splits == [("engine", "late"), ("gateway", "mine"), ("engine", "retry")]


def test_ranges_off_the_hour_add_the_edges_from_the_events(ledger):
    ledger.record([event(f"e{i}", finished_at=T0 + i * 600.5, prompt_tokens=i)
                   for i in range(30)])
    for start, end in ((T0 + 1000.25, T0 + 5 * H + 17), (T0 + 0.5, None), (None, T0 + 2 * H + 1),
                       (T0 + H, T0 + 3 * H)):
        rows = same(ledger, UsageQuery(start=start, end=end, group_by=(GroupBy.TIME,),
                                       bucket_seconds=2 * H))
        lo, hi = start or 0, end or float("inf")
        want = [i for i in range(30) if lo <= T0 + i * 600.5 < hi]
        assert sum(r.requests for r in rows) == len(want)
        assert sum(r.prompt_tokens for r in rows) == sum(want)
    # no whole hour inside, or a bucket that is not whole hours: the events answer
    assert rollup.plan(UsageQuery(start=T0 + 10, end=T0 + H + 10)) is None
    assert rollup.plan(UsageQuery(group_by=(GroupBy.TIME,), bucket_seconds=900)) is None
    assert rollup.plan(UsageQuery(start=T0 + 10, end=T0 + 2 * H + 10)).edges == (
        (T0 + 10, T0 + H), (T0 + 2 * H, T0 + 2 * H + 10))


def random_events(rng: random.Random, n: int):
    events = []
    for i in range(n):
        # a few request ids recur (retries, reused ids, the other source's record)
        rid = f"r{rng.randrange(n // 3)}" if rng.random() < 0.3 else f"u{i}"
        events.append(event(
            f"e{i}", request_id=rid, source=rng.choice([Source.GATEWAY, ENGINE]),
            tenant_id=rng.choice(["t1", "t2", "t3"]), app=rng.choice(["a", "b"]),
            model_version=rng.choice(["v1", "v2"]), tier=rng.choice(["free", "pro"]),
            prompt_tokens=rng.randrange(100), completion_tokens=rng.randrange(50),
            cached_tokens=0, energy_joules=rng.randrange(40) / 4,
            energy_estimated=rng.random() < 0.2,
            # many near hour boundaries
            finished_at=T0 + rng.randrange(8) * H + rng.choice(
                [0.0, 0.001, H - 0.001, rng.random() * H])))
    return events


def random_query(rng: random.Random) -> UsageQuery:
    def bound():
        return T0 + rng.randrange(-1, 9) * H + rng.choice([0, 0, 0.5, 1234.0])

    start, end = sorted([bound(), bound()])
    if start == end:
        end += H
    groups = tuple(g for g in GroupBy if rng.random() < 0.35)
    return UsageQuery(
        tenant_id=rng.choice(["", "", "t1", "t3"]), start=rng.choice([start, None]),
        end=rng.choice([end, None]), group_by=groups,
        bucket_seconds=rng.choice([H, 2 * H, 3 * H, 86400, 1800]),
        source=rng.choice([Source.GATEWAY, ENGINE]))


def test_random_batches_and_queries_agree_between_the_rollup_and_the_events(ledger):
    rng = random.Random(14)
    events = random_events(rng, 400)
    i = 0
    while i < len(events):  # batches of random size, some events sent twice
        n = rng.randrange(1, 60)
        batch = events[i:i + n] + rng.sample(events[:i + n], min(5, i + n))
        ledger.record(batch)
        i += n
    checked = 0
    for _ in range(150):
        q = random_query(rng)
        if rollup.plan(q) is None:
            continue
        same(ledger, q)
        checked += 1
    assert checked > 80
    (total,) = same(ledger, UsageQuery())
    assert total.prompt_tokens == sum(e.prompt_tokens for e in events
                                      if e.source is Source.GATEWAY)


def test_replicas_writing_records_of_the_same_requests_at_once_stay_exact(postgres_url):
    """Two ledgers on one PostgreSQL, each with other records of the same requests (an
    engine retry reported to another meter replica), recording at the same time."""
    ledgers = [Ledger.open(postgres_url), Ledger.open(postgres_url)]
    go = threading.Barrier(2)

    def send(led: Ledger, version: str):
        go.wait()
        for b in range(10):
            led.record([event(f"{version}-{b}-{i}", request_id=f"r{b}-{i}", source=ENGINE,
                              model_version=version, finished_at=T0 + b)
                        for i in range(50)])

    threads = [threading.Thread(target=send, args=(led, v))
               for led, v in zip(ledgers, ("v1", "v2"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (total,) = same(ledgers[0], UsageQuery(source=ENGINE))
    assert total.requests == 500
    rows = same(ledgers[0], UsageQuery(source=ENGINE, group_by=(GroupBy.VERSION,)))
    assert [(r.keys, r.requests) for r in rows] == [(("v1",), 500), (("v2",), 500)]
    for led in ledgers:
        led.close()
