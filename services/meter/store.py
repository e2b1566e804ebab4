"""The usage ledger: one table of events, deduplicated by event id.

SQLite (WAL, synchronous=FULL: a commit is on disk before RecordUsage replies) by default;
PostgreSQL when the location is a postgresql:// URL, so that several meter replicas share
one ledger. The SQL is the same for both except placeholders and the time-bucket function.

A ledger object is not thread-safe: the servicer calls it from one worker thread.
"""
from __future__ import annotations

import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from services.meter.usage import (GroupBy, RecordResult, Source, UsageEvent, UsageQuery,
                                  UsageRow)

COLUMNS = ("event_id", "request_id", "source", "tenant_id", "app", "model", "model_version",
           "tier", "prompt_tokens", "completion_tokens", "cached_tokens", "status",
           "started_at", "finished_at", "energy_joules", "energy_estimated")

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS usage_events (
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
    "CREATE INDEX IF NOT EXISTS usage_by_request ON usage_events (request_id)",
)

_INSERT = (f"INSERT INTO usage_events ({', '.join(COLUMNS)}) VALUES "
           f"({', '.join('?' for _ in COLUMNS)}) ON CONFLICT (event_id) DO NOTHING")


def _row_of(e: UsageEvent) -> tuple:
    return (e.event_id, e.request_id, e.source.value, e.tenant_id, e.app, e.model,
            e.model_version, e.tier, e.prompt_tokens, e.completion_tokens, e.cached_tokens,
            e.status, e.started_at, e.finished_at, e.energy_joules, int(e.energy_estimated))


def _event_of(row: Sequence) -> UsageEvent:
    d = dict(zip(COLUMNS, row))
    d["source"] = Source(d["source"])
    d["energy_estimated"] = bool(d["energy_estimated"])
    for k in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        d[k] = int(d[k])
    return UsageEvent(**d)


class Ledger:
    """Stores and sums usage events. Open with `Ledger.open(location)`."""

    def __init__(self, conn, *, postgres: bool):
        self._conn = conn
        self._postgres = postgres
        cur = conn.cursor()
        for stmt in _SCHEMA:
            cur.execute(stmt)

    @classmethod
    def open(cls, location: str) -> "Ledger":
        if location.startswith(("postgresql://", "postgres://")):
            import psycopg  # only needed for shared ledgers

            # Autocommit: reads never hold a transaction open; `record` opens its own.
            return cls(psycopg.connect(location, autocommit=True), postgres=True)
        path = Path(location)
        path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per batch.
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA busy_timeout=5000")
        return cls(conn, postgres=False)

    def close(self):
        self._conn.close()

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self._postgres else sql

    def _execute(self, sql: str, params: Sequence = ()):
        cur = self._conn.cursor()
        cur.execute(self._sql(sql), params)
        return cur

    def record(self, events: Sequence[UsageEvent]) -> RecordResult:
        """Stores the events not seen before, in one transaction; durable on return."""
        if not events:
            return RecordResult(0, 0)
        accepted: dict[Source, int] = {}
        sql = self._sql(_INSERT)
        with self._transaction():
            cur = self._conn.cursor()
            for e in events:
                cur.execute(sql, _row_of(e))
                if cur.rowcount > 0:
                    accepted[e.source] = accepted.get(e.source, 0) + 1
        n = sum(accepted.values())
        return RecordResult(accepted=n, duplicates=len(events) - n, accepted_by_source=accepted)

    @contextmanager
    def _transaction(self):
        if self._postgres:
            with self._conn.transaction():
                yield
            return
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def _where(self, q: UsageQuery, source: Source | None) -> tuple[str, list]:
        clauses, params = [], []
        if source is not None:
            clauses.append("source = ?")
            params.append(source.value)
        if q.tenant_id:
            clauses.append("tenant_id = ?")
            params.append(q.tenant_id)
        if q.start is not None:
            clauses.append("finished_at >= ?")
            params.append(q.start)
        if q.end is not None:
            clauses.append("finished_at < ?")
            params.append(q.end)
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", params

    def _dimension(self, g: GroupBy, bucket: int) -> str:
        if g is not GroupBy.TIME:
            return g.value
        # Timestamps are >= 0, so truncation is floor; the bucket is an int we own, not input text.
        if self._postgres:
            return f"CAST(FLOOR(finished_at / {bucket}) * {bucket} AS BIGINT)"
        return f"CAST(finished_at / {bucket} AS INTEGER) * {bucket}"

    def query(self, q: UsageQuery) -> list[UsageRow]:
        """Sums per group, groups ordered by their keys; no group_by gives one total row."""
        dims = [self._dimension(g, int(q.bucket_seconds)) for g in q.group_by]
        where, params = self._where(q, q.source)
        select = ", ".join([*dims, "COUNT(DISTINCT request_id)", "SUM(prompt_tokens)",
                            "SUM(completion_tokens)", "SUM(cached_tokens)",
                            "SUM(energy_joules)"])
        sql = f"SELECT {select} FROM usage_events{where}"
        if dims:
            order = ", ".join(str(i + 1) for i in range(len(dims)))
            sql += f" GROUP BY {order} ORDER BY {order}"
        rows = []
        for r in self._execute(sql, params).fetchall():
            n = len(dims)
            if not dims and r[0] == 0:
                continue
            rows.append(UsageRow(
                keys=tuple(str(k) for k in r[:n]), requests=int(r[n]),
                prompt_tokens=int(r[n + 1] or 0), completion_tokens=int(r[n + 2] or 0),
                cached_tokens=int(r[n + 3] or 0), energy_joules=float(r[n + 4] or 0.0)))
        return rows

    def events(self, q: UsageQuery, *, all_sources: bool = False) -> Iterator[UsageEvent]:
        """Matching events in finish order (ties by event id)."""
        where, params = self._where(q, None if all_sources else q.source)
        sql = (f"SELECT {', '.join(COLUMNS)} FROM usage_events{where}"
               " ORDER BY finished_at, event_id")
        cur = self._execute(sql, params)
        while batch := cur.fetchmany(1000):
            for row in batch:
                yield _event_of(row)

    def totals_by_request(self, q: UsageQuery) -> dict[tuple[str, str], tuple[int, int]]:
        """(request_id, source) -> (prompt_tokens, completion_tokens), summed over events."""
        where, params = self._where(q, None)
        sql = ("SELECT request_id, source, SUM(prompt_tokens), SUM(completion_tokens)"
               f" FROM usage_events{where} GROUP BY request_id, source")
        return {(r[0], r[1]): (int(r[2]), int(r[3]))
                for r in self._execute(sql, params).fetchall()}
