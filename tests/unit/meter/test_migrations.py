"""Schema migrations on real databases: a new ledger gets the latest schema (whose columns
are exactly the usage record's fields), a walking-skeleton ledger is upgraded in place with
its rows kept, and a ledger from a newer meter is refused."""
from __future__ import annotations

import sqlite3

import pytest

from services.meter import migrations
from services.meter.store import Ledger
from services.meter.usage import UsageQuery
from tests.unit.meter.conftest import event
from tokenserve.usage import FIELDS, Source, to_row


def raw(location: str):
    """A plain connection to the same database (autocommit) and its placeholder."""
    if location.startswith("postgresql://"):
        import psycopg

        return psycopg.connect(location, autocommit=True), "%s"
    return sqlite3.connect(location, isolation_level=None), "?"


def columns(conn, location: str) -> set[str]:
    if location.startswith("postgresql://"):
        rows = conn.execute("SELECT column_name FROM information_schema.columns WHERE"
                            " table_name = 'usage_events' AND table_schema = current_schema()")
        return {r[0] for r in rows.fetchall()}
    return {r[1] for r in conn.execute("PRAGMA table_info(usage_events)").fetchall()}


def versions(conn) -> list[int]:
    return [r[0] for r in conn.execute("SELECT version FROM schema_version ORDER BY 1").fetchall()]


def test_a_new_ledger_has_the_latest_schema_with_one_column_per_usage_field(ledger_location):
    Ledger.open(ledger_location).close()
    conn, _ = raw(ledger_location)
    assert columns(conn, ledger_location) == set(FIELDS)
    assert versions(conn) == list(range(1, migrations.LATEST + 1))
    conn.close()
    Ledger.open(ledger_location).close()  # reopening applies nothing twice


def test_a_ledger_made_by_the_previous_schema_is_upgraded_and_keeps_its_rows(ledger_location):
    conn, p = raw(ledger_location)
    for stmt in migrations.MIGRATIONS[0]:  # exactly what the walking skeleton created
        conn.execute(stmt)
    old_columns = ("event_id", "request_id", "source", "tenant_id", "app", "model",
                   "model_version", "tier", "prompt_tokens", "completion_tokens",
                   "cached_tokens", "status", "started_at", "finished_at", "energy_joules",
                   "energy_estimated")
    conn.execute(f"INSERT INTO usage_events ({', '.join(old_columns)}) VALUES"
                 f" ({', '.join(p for _ in old_columns)})",
                 ("old", "r-old", "gateway", "t1", "app", "m", "v1", "free", 7, 3, 1, "OK",
                  1000.0, 1001.0, 0.5, 0))
    led = Ledger.open(ledger_location)
    (old,) = led.events(UsageQuery())
    assert (old.event_id, old.prompt_tokens, old.completion_tokens, old.energy_joules) == (
        "old", 7, 3, 0.5)
    assert (old.finish_reason, old.preempted, old.cancelled) == ("", False, False)
    assert led.record([event("new", source=Source.ENGINE, preempted=True)]).accepted == 1
    led.close()
    assert versions(conn) == list(range(1, migrations.LATEST + 1))
    assert columns(conn, ledger_location) == set(FIELDS)
    conn.close()


def test_a_ledger_from_a_newer_meter_is_refused(ledger_location):
    Ledger.open(ledger_location).close()
    conn, p = raw(ledger_location)
    conn.execute(f"INSERT INTO schema_version (version, applied_at) VALUES ({p}, {p})",
                 (migrations.LATEST + 1, 0.0))
    conn.close()
    with pytest.raises(migrations.SchemaTooNew, match="newer than this meter knows"):
        Ledger.open(ledger_location)


def test_the_rollup_is_backfilled_from_a_ledger_of_the_previous_schema(ledger_location):
    from services.meter.usage import GroupBy
    from tests.unit.meter.test_rollup import T0, H, same

    conn, p = raw(ledger_location)
    conn.execute(migrations.VERSION_TABLE)
    for number in (1, 2):  # what the meter before the rollup created
        for stmt in migrations.MIGRATIONS[number - 1]:
            conn.execute(stmt)
        conn.execute(f"INSERT INTO schema_version (version, applied_at) VALUES ({p}, {p})",
                     (number, 0.0))
    old = [event("g1", request_id="a", finished_at=T0 + 10),
           event("g2", request_id="b", finished_at=T0 + 20, energy_joules=0.5),
           event("g3", request_id="b", finished_at=T0 + 30),  # a reused id, one key
           event("e1", request_id="a", source=Source.ENGINE, model_version="v1",
                 finished_at=T0 + 11, finish_reason="error"),
           event("e2", request_id="a", source=Source.ENGINE, model_version="v2",
                 finished_at=T0 + 12),  # a retry on another version: split
           event("g4", request_id="c", finished_at=T0 + H + 5, energy_estimated=True)]
    conn.cursor().executemany(f"INSERT INTO usage_events ({', '.join(FIELDS)}) VALUES"
                     f" ({', '.join(p for _ in FIELDS)})", [to_row(e) for e in old])
    led = Ledger.open(ledger_location)
    assert versions(conn) == list(range(1, migrations.LATEST + 1))
    (total,) = same(led, UsageQuery())
    assert (total.requests, total.prompt_tokens, total.energy_joules,
            total.energy_estimated) == (3, 40, 0.5, True)
    rows = same(led, UsageQuery(source=Source.ENGINE, group_by=(GroupBy.VERSION,)))
    assert [(r.keys, r.requests) for r in rows] == [(("v1",), 1), (("v2",), 1)]
    (engine,) = same(led, UsageQuery(source=Source.ENGINE))
    assert engine.requests == 1
    # Records after the upgrade join the backfilled ones: b moves to a second hour (split),
    # c gets the engine's record (another source).
    led.record([event("g5", request_id="b", finished_at=T0 + H + 50),
                event("e3", request_id="c", source=Source.ENGINE, finished_at=T0 + H + 6)])
    rows = same(led, UsageQuery(group_by=(GroupBy.TIME,)))
    assert [(r.keys, r.requests) for r in rows] == [((str(T0),), 2), ((str(T0 + H),), 2)]
    (total,) = same(led, UsageQuery())
    assert total.requests == 3
    led.close()
    conn.close()
