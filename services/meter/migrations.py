"""Versioned schema of the ledger: forward migrations, applied in order at start.

`schema_version` holds one row per applied migration. A database made by a newer meter
(a version this code does not know) is refused rather than written with the wrong columns.
Version 1 is the table the walking skeleton created without a `schema_version` table; such
a database is recognised and upgraded. Migrations are history: never edit one that shipped,
append the next. The latest schema's columns must equal `tokenserve.usage.FIELDS` (a test
checks), so adding a usage field means adding a migration here.

A statement may name a dialect's text as `{hour}` (the exact start of finished_at's hour)
or `{without_rowid}` (SQLite's clustered table); `statements` fills them in.
"""
from __future__ import annotations

from typing import Mapping

from tokenserve.runtime.errors import FailedPrecondition

# Each migration: statements run in one transaction with the version row.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: the walking skeleton's ledger
    ("""CREATE TABLE IF NOT EXISTS usage_events (
        event_id TEXT PRIMARY KEY,
        request_id TEXT NOT NULL,
        source TEXT NOT NULL,
        tenant_id TEXT NOT NULL,
        app TEXT NOT NULL,
        model TEXT NOT NULL,
        model_version TEXT NOT NULL,
        tier TEXT NOT NULL,
        prompt_tokens BIGINT NOT NULL,
        completion_tokens BIGINT NOT NULL,
        cached_tokens BIGINT NOT NULL,
        status TEXT NOT NULL,
        started_at DOUBLE PRECISION NOT NULL,
        finished_at DOUBLE PRECISION NOT NULL,
        energy_joules DOUBLE PRECISION NOT NULL,
        energy_estimated INTEGER NOT NULL
    )""",
     "CREATE INDEX IF NOT EXISTS usage_by_time ON usage_events (source, finished_at)",
     "CREATE INDEX IF NOT EXISTS usage_by_tenant ON usage_events (tenant_id, finished_at)",
     "CREATE INDEX IF NOT EXISTS usage_by_request ON usage_events (request_id)"),
    # 2: the engine's own record (finish reason, preempted, cancelled)
    ("ALTER TABLE usage_events ADD COLUMN finish_reason TEXT NOT NULL DEFAULT ''",
     "ALTER TABLE usage_events ADD COLUMN preempted INTEGER NOT NULL DEFAULT 0",
     "ALTER TABLE usage_events ADD COLUMN cancelled INTEGER NOT NULL DEFAULT 0"),
    # 3: the hourly rollup (services/meter/rollup.py), backfilled from the events
    ("""CREATE TABLE usage_hourly (
        source TEXT NOT NULL,
        tenant_id TEXT NOT NULL,
        hour BIGINT NOT NULL,
        app TEXT NOT NULL,
        model TEXT NOT NULL,
        model_version TEXT NOT NULL,
        tier TEXT NOT NULL,
        events BIGINT NOT NULL,
        requests BIGINT NOT NULL,
        prompt_tokens BIGINT NOT NULL,
        completion_tokens BIGINT NOT NULL,
        cached_tokens BIGINT NOT NULL,
        energy_joules DOUBLE PRECISION NOT NULL,
        energy_estimated INTEGER NOT NULL,
        PRIMARY KEY (source, tenant_id, hour, app, model, model_version, tier)
    ){without_rowid}""",
     """CREATE TABLE usage_split_requests (
        source TEXT NOT NULL,
        request_id TEXT NOT NULL,
        first_hour BIGINT NOT NULL,
        last_hour BIGINT NOT NULL,
        PRIMARY KEY (request_id, source)
    )""",
     # a request whose records fall under more than one rollup key
     """INSERT INTO usage_split_requests (source, request_id, first_hour, last_hour)
        SELECT source, request_id, MIN(hour), MAX(hour) FROM (
            SELECT DISTINCT source, request_id, tenant_id, app, model, model_version, tier,
                   {hour} AS hour FROM usage_events) k
        GROUP BY source, request_id HAVING COUNT(*) > 1""",
     """INSERT INTO usage_hourly (source, tenant_id, hour, app, model, model_version, tier,
            events, requests, prompt_tokens, completion_tokens, cached_tokens,
            energy_joules, energy_estimated)
        SELECT e.source, e.tenant_id, {hour}, e.app, e.model, e.model_version, e.tier,
               COUNT(*), COUNT(DISTINCT CASE WHEN s.request_id IS NULL THEN e.request_id END),
               SUM(e.prompt_tokens), SUM(e.completion_tokens), SUM(e.cached_tokens),
               SUM(e.energy_joules), MAX(e.energy_estimated)
        FROM usage_events e LEFT JOIN usage_split_requests s
             ON s.source = e.source AND s.request_id = e.request_id
        GROUP BY e.source, e.tenant_id, {hour}, e.app, e.model, e.model_version, e.tier"""),
)
LATEST = len(MIGRATIONS)

VERSION_TABLE = ("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY,"
                  " applied_at DOUBLE PRECISION NOT NULL)")


class SchemaTooNew(FailedPrecondition):
    pass


def current_version(cur, *, legacy_table: bool) -> int:
    """The highest applied version; 1 for a skeleton ledger with no version rows yet."""
    cur.execute("SELECT MAX(version) FROM schema_version")
    v = cur.fetchone()[0]
    if v is None:
        return 1 if legacy_table else 0
    return int(v)


def statements(number: int, dialect: Mapping[str, str]) -> tuple[str, ...]:
    """Migration `number`'s statements with the dialect's texts filled in."""
    return tuple(stmt.format_map(dialect) for stmt in MIGRATIONS[number - 1])


def pending(version: int, dialect: Mapping[str, str]) -> list[tuple[int, tuple[str, ...]]]:
    """Migrations after `version`, filled in for the dialect; raises SchemaTooNew for a
    version this code lacks."""
    if version > LATEST:
        raise SchemaTooNew(
            f"the ledger's schema is version {version}, newer than this meter knows"
            f" ({LATEST}); run a meter at least as new as the one that wrote it")
    return [(n, statements(n, dialect)) for n in range(version + 1, LATEST + 1)]
