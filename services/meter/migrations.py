"""Versioned schema of the ledger: forward migrations, applied in order at start.

`schema_version` holds one row per applied migration. A database made by a newer meter
(a version this code does not know) is refused rather than written with the wrong columns.
Version 1 is the table the walking skeleton created without a `schema_version` table; such
a database is recognised and upgraded. Migrations are history: never edit one that shipped,
append the next. The latest schema's columns must equal `tokenserve.usage.FIELDS` (a test
checks), so adding a usage field means adding a migration here.
"""
from __future__ import annotations

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


def pending(version: int) -> list[tuple[int, tuple[str, ...]]]:
    """Migrations after `version`; raises SchemaTooNew for a version this code lacks."""
    if version > LATEST:
        raise SchemaTooNew(
            f"the ledger's schema is version {version}, newer than this meter knows"
            f" ({LATEST}); run a meter at least as new as the one that wrote it")
    return [(n, MIGRATIONS[n - 1]) for n in range(version + 1, LATEST + 1)]
