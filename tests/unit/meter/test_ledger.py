"""The ledger on a real database: dedupe, durability across reopen, grouping, filters."""
from __future__ import annotations

from services.meter.export import csv_chunks
from services.meter.store import Ledger
from tokenserve.usage import FIELDS
from services.meter.usage import GroupBy, UsageQuery
from tests.unit.meter.conftest import event
from tokenserve.usage import Source


def test_duplicates_are_stored_once_within_and_across_batches(ledger):
    first = ledger.record([event("a"), event("b"), event("a")])
    assert (first.accepted, first.duplicates) == (2, 1)
    again = ledger.record([event("b", prompt_tokens=99), event("c")])
    assert (again.accepted, again.duplicates) == (1, 1)
    (total,) = ledger.query(UsageQuery())
    assert (total.requests, total.prompt_tokens) == (3, 30)  # b's second copy ignored


def test_accepted_counts_are_split_by_source(ledger):
    r = ledger.record([event("g1"), event("e1", source=Source.ENGINE), event("g1")])
    assert r.accepted_by_source == {Source.GATEWAY: 1, Source.ENGINE: 1}


def test_events_survive_reopening_the_file(tmp_path):
    path = str(tmp_path / "ledger.db")
    led = Ledger.open(path)
    led.record([event("a"), event("b")])
    led.close()
    reopened = Ledger.open(path)
    assert reopened.record([event("a")]).duplicates == 1
    assert [e.event_id for e in reopened.events(UsageQuery())] == ["a", "b"]
    reopened.close()


def test_group_by_tenant_and_model_sums_each_group(ledger):
    ledger.record([
        event("1", tenant_id="t1", model="m1", prompt_tokens=1, completion_tokens=2),
        event("2", tenant_id="t1", model="m1", prompt_tokens=3, completion_tokens=4),
        event("3", tenant_id="t1", model="m2", prompt_tokens=5, completion_tokens=6),
        event("4", tenant_id="t2", model="m1", prompt_tokens=7, completion_tokens=8),
    ])
    rows = ledger.query(UsageQuery(group_by=(GroupBy.TENANT, GroupBy.MODEL)))
    got = {r.keys: (r.requests, r.prompt_tokens, r.completion_tokens) for r in rows}
    assert got == {("t1", "m1"): (2, 4, 6), ("t1", "m2"): (1, 5, 6), ("t2", "m1"): (1, 7, 8)}


def test_group_by_time_buckets_by_finish_time(ledger):
    ledger.record([event("1", started_at=3500, finished_at=3599.5),
                   event("2", started_at=3600, finished_at=3600.0),
                   event("3", started_at=3700, finished_at=7199.0),
                   event("4", started_at=7100, finished_at=7200.0)])
    rows = ledger.query(UsageQuery(group_by=(GroupBy.TIME,), bucket_seconds=3600))
    assert [(r.keys, r.requests) for r in rows] == [(("0",), 1), (("3600",), 2), (("7200",), 1)]


def test_tenant_and_time_filters_are_half_open(ledger):
    ledger.record([event("1", tenant_id="t1", finished_at=1010),
                   event("2", tenant_id="t1", finished_at=1020),
                   event("3", tenant_id="t2", finished_at=1010)])
    (row,) = ledger.query(UsageQuery(tenant_id="t1", start=1010, end=1020))
    assert row.requests == 1
    assert ledger.query(UsageQuery(tenant_id="nobody")) == []


def test_source_selects_whose_records_are_counted(ledger):
    ledger.record([event("g", request_id="r1", completion_tokens=5),
                   event("e", request_id="r1", source=Source.ENGINE, completion_tokens=7)])
    (billed,) = ledger.query(UsageQuery())
    (engine,) = ledger.query(UsageQuery(source=Source.ENGINE))
    assert (billed.completion_tokens, engine.completion_tokens) == (5, 7)


def test_csv_export_has_a_header_and_one_line_per_event(ledger):
    ledger.record([event(f"e{i:04d}", finished_at=1000 + i) for i in range(1200)])
    text = "".join(csv_chunks(ledger.events(UsageQuery())))
    lines = text.splitlines()
    assert lines[0].startswith("event_id,request_id,source,tenant_id")
    assert lines[0].count(",") + 1 == len(FIELDS)
    assert len(lines) == 1201
    assert lines[1].split(",")[:3] == ["e0000", "r-e0000", "gateway"]


def test_rows_carry_totals_tokens_per_joule_and_the_estimated_flag(ledger):
    ledger.record([
        event("1", model_version="v1", tier="free", prompt_tokens=10, completion_tokens=10,
              energy_joules=4.0),
        event("2", model_version="v1", tier="premium", prompt_tokens=2, completion_tokens=3,
              energy_joules=1.0, energy_estimated=True),
        event("3", model_version="v2", tier="free", prompt_tokens=1, completion_tokens=1),
    ])
    rows = ledger.query(UsageQuery(group_by=(GroupBy.VERSION, GroupBy.TIER)))
    got = {r.keys: (r.requests, r.total_tokens, r.energy_joules, r.tokens_per_joule,
                    r.energy_estimated) for r in rows}
    assert got == {("v1", "free"): (1, 20, 4.0, 5.0, False),
                   ("v1", "premium"): (1, 5, 1.0, 5.0, True),
                   ("v2", "free"): (1, 2, 0.0, 0.0, False)}


def test_sqlite_ledger_runs_in_wal_mode(tmp_path):
    led = Ledger.open(str(tmp_path / "meter.db"))
    assert led.journal_mode() == "wal"
    led.close()
