"""The usage ledger: one table of events, deduplicated by event id, and its hourly rollup.

SQLite (WAL, synchronous=FULL: a commit is on disk before RecordUsage replies) by default;
PostgreSQL when the location is a postgresql:// URL, so that several meter replicas share
one ledger. The SQL is the same for both but for what dialect.py holds.

A batch's events and its rollup update (rollup.py) commit together. The update reads the
earlier records of the batch's requests, so batches commit one at a time: SQLite's write
lock, and on PostgreSQL an advisory lock that replicas share (without it, two replicas
storing records of one request at once could each count it). Replicas on one PostgreSQL
keep the ledger writable when one stops; they do not add write throughput. QueryUsage
reads the rollup where it can (queries.py).

A ledger object is not thread-safe: the servicer calls it from one worker thread.
"""
from __future__ import annotations

import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from services.meter import migrations, queries, rollup
from services.meter.dialect import Dialect, columns, unnest
from services.meter.usage import RecordResult, UsageQuery, UsageRow
from tokenserve.usage import FIELDS, TYPES, Source, UsageRecord, from_row, to_row

_INSERT = (f"INSERT INTO usage_events ({', '.join(FIELDS)}) VALUES "
           f"({', '.join('?' for _ in FIELDS)}) ON CONFLICT (event_id) DO NOTHING")
_EVENT_TYPES = tuple({str: "text", Source: "text", int: "bigint", float: "float8",
                      bool: "int"}[TYPES[n]] for n in FIELDS)
_PG_INSERT = (f"INSERT INTO usage_events ({', '.join(FIELDS)}) {unnest(_EVENT_TYPES)}"
              " ON CONFLICT (event_id) DO NOTHING RETURNING event_id")
_HOURLY = (*rollup.KEY_COLUMNS, *rollup.SUM_COLUMNS)
# usage_hourly's columns (migration 3) as PostgreSQL names their types, in _HOURLY order.
_HOURLY_TYPES = ("text", "text", "bigint", "text", "text", "text", "text",
                 "bigint", "bigint", "bigint", "bigint", "bigint", "float8", "int")
_UPSERT_HOURLY = (
    f"INSERT INTO usage_hourly ({', '.join(_HOURLY)}) {{rows}}"
    f" ON CONFLICT ({', '.join(rollup.KEY_COLUMNS)}) DO UPDATE SET "
    + ", ".join(f"{c} = usage_hourly.{c} + excluded.{c}" for c in rollup.SUM_COLUMNS[:-1])
    + ", energy_estimated = {greatest}(usage_hourly.energy_estimated,"
      " excluded.energy_estimated)")
_UPSERT_SPLIT = (
    "INSERT INTO usage_split_requests (source, request_id, first_hour, last_hour)"
    " VALUES (?, ?, ?, ?) ON CONFLICT (source, request_id) DO UPDATE SET"
    " first_hour = {least}(usage_split_requests.first_hour, excluded.first_hour),"
    " last_hour = {greatest}(usage_split_requests.last_hour, excluded.last_hour)")
# Serialises schema migrations of replicas that start together on one PostgreSQL.
_MIGRATION_LOCK = 0x75736167
# Serialises the batches of replicas on one PostgreSQL (see the module docstring).
_INGEST_LOCK = 0x75736168


class Ledger:
    """Stores and sums usage events. Open with `Ledger.open(location)`."""

    def __init__(self, conn, *, postgres: bool):
        self._conn = conn
        self._postgres = postgres
        self._d = d = Dialect(postgres)
        rows = unnest(_HOURLY_TYPES) if postgres else f"VALUES ({', '.join('?' * len(_HOURLY))})"
        self._upsert_hourly = _UPSERT_HOURLY.format(rows=rows, greatest=d.greatest)
        self._upsert_split = d.sql(_UPSERT_SPLIT.format(least=d.least, greatest=d.greatest))
        self.schema_version = self._migrate()

    def _migrate(self) -> int:
        """Applies the pending migrations (all in one transaction); returns the version."""
        with self._transaction():
            cur = self._conn.cursor()
            if self._postgres:
                cur.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            legacy = self._has_table(cur, "usage_events")
            cur.execute(migrations.VERSION_TABLE)
            version = migrations.current_version(cur, legacy_table=legacy)
            steps = migrations.pending(version, self._d.migration_texts(rollup.HOUR))
            if legacy and version == 1:
                steps.insert(0, (1, ()))  # the skeleton's table: record it as version 1
            for number, statements in steps:
                for stmt in statements:
                    cur.execute(stmt)
                cur.execute(self._d.sql("INSERT INTO schema_version (version, applied_at)"
                                      " VALUES (?, ?)"), (number, time.time()))
        return migrations.LATEST

    def _has_table(self, cur, name: str) -> bool:
        if self._postgres:
            cur.execute("SELECT to_regclass(%s) IS NOT NULL", (name,))
        else:
            cur.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
                        (name,))
        return bool(cur.fetchone()[0])

    def journal_mode(self) -> str:
        """SQLite's journal mode ("wal"); "postgresql" for a shared ledger."""
        if self._postgres:
            return "postgresql"
        return self._conn.execute("PRAGMA journal_mode").fetchone()[0]

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
        # A tenant's month is scattered over the table: keep hot pages in the process (64 MiB
        # page cache) and read the rest through a mapping instead of a read() per page.
        # Measured over 1 M events: a tenant's month query 65 -> 46 ms, ingest +5-15%.
        conn.execute("PRAGMA cache_size=-65536")
        conn.execute("PRAGMA mmap_size=268435456")
        return cls(conn, postgres=False)

    def close(self):
        self._conn.close()

    def _execute(self, sql: str, params: Sequence = ()):
        cur = self._conn.cursor()
        cur.execute(self._d.sql(sql), params)
        return cur

    def record(self, events: Sequence[UsageRecord]) -> RecordResult:
        """Stores the events not seen before and adds them to the rollup, all in one
        transaction (a crash leaves none of the batch); durable on return."""
        if not events:
            return RecordResult(0, 0)
        # The first of each event id, in id order (overlapping batches lock ids in one order).
        unique = list({e.event_id: e for e in reversed(events)}.values())
        unique.sort(key=lambda e: e.event_id)
        with self._transaction():
            cur = self._conn.cursor()
            if self._postgres:
                cur.execute("SELECT pg_advisory_xact_lock(%s)", (_INGEST_LOCK,))
            before, split = self._requests_before(cur, unique)
            new = self._insert_new(cur, unique)
            if new:
                self._roll_up(cur, rollup.delta(new, before, split))
        accepted: dict[Source, int] = {}
        for e in new:
            accepted[e.source] = accepted.get(e.source, 0) + 1
        return RecordResult(accepted=len(new), duplicates=len(events) - len(new),
                            accepted_by_source=accepted)

    def _requests_before(self, cur, events: list[UsageRecord]
                         ) -> tuple[dict[rollup.RequestRef, set[rollup.Key]],
                                    set[rollup.RequestRef]]:
        """For the events' requests, as stored before this batch: the rollup keys of each
        one's records (only for requests not split yet) and which ones are split."""
        refs = {(rollup.SOURCE_TEXT[e.source], e.request_id) for e in events}
        request_ids = list({r for _, r in refs})
        split = {ref for ref in self._d.rows_in(
            cur, "SELECT source, request_id FROM usage_split_requests WHERE {in}",
            "request_id", request_ids) if ref in refs}
        before: dict[rollup.RequestRef, set[rollup.Key]] = {}
        # Usually nothing: the other source's record of a request, or a resent event.
        for source, request_id, *labels, finished in self._d.rows_in(
                cur, "SELECT source, request_id, tenant_id, app, model, model_version, tier,"
                     " finished_at FROM usage_events WHERE {in}",
                "request_id", list({r for _, r in refs - split})):
            if (source, request_id) in refs:
                before.setdefault((source, request_id), set()).add(
                    rollup.key_of(source, *labels, finished))
        return before, split

    def _insert_new(self, cur, events: list[UsageRecord]) -> list[UsageRecord]:
        """Inserts the events (one per id); returns those not stored before."""
        if self._postgres:
            # One statement for the batch; what it inserted is what the database says.
            cur.execute(_PG_INSERT, columns(map(to_row, events), _EVENT_TYPES))
            stored = {row[0] for row in cur.fetchall()}
            return [e for e in events if e.event_id in stored]
        # The write lock is held (BEGIN IMMEDIATE): what is there now stays so.
        seen = {r[0] for r in self._d.rows_in(cur, "SELECT event_id FROM usage_events"
                                            " WHERE {in}", "event_id",
                                            [e.event_id for e in events])}
        new = [e for e in events if e.event_id not in seen]
        cur.executemany(_INSERT, map(to_row, new))
        return new

    def _roll_up(self, cur, d: rollup.Delta) -> None:
        # In key order: neighbouring rows of the table, which is clustered by its key.
        rows = sorted((*k, *v.values()) for k, v in d.sums.items())
        if self._postgres:
            cur.execute(self._upsert_hourly, columns(rows, _HOURLY_TYPES))
        else:
            cur.executemany(self._upsert_hourly, rows)
        if d.splits:
            cur.executemany(self._upsert_split,
                            [(*ref, *span) for ref, span in sorted(d.splits.items())])

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

    def query(self, q: UsageQuery, *, from_events: bool = False) -> list[UsageRow]:
        """Sums per group, groups ordered by their keys; no group_by gives one total row.
        From the rollup where it helps (rollup.plan), unless `from_events`."""
        plan = None if from_events else rollup.plan(q)
        if plan is None:
            sql, params = queries.from_events(q, self._d)
            return queries.usage_rows(self._execute(sql, params).fetchall(), len(q.group_by),
                                      {})
        sql, params = queries.from_rollup(q, plan, self._d)
        rows = self._execute(sql, params).fetchall()
        return queries.usage_rows(rows, len(q.group_by), self._split_requests(q))

    def _split_requests(self, q: UsageQuery) -> dict[tuple, int]:
        """group keys -> distinct split requests in the group (the rollup leaves them out)."""
        ids = [r[0] for r in self._execute(*queries.split_ids(q)).fetchall()]
        sql, params = queries.split_counts(q, self._d)
        out: dict[tuple, int] = {}
        # Each request id is in one chunk, so the chunks' distinct counts add up.
        for *keys, n in self._d.rows_in(self._conn.cursor(), sql, "request_id", ids, params):
            keys = tuple(str(k) for k in keys)
            out[keys] = out.get(keys, 0) + int(n)
        return out

    def events(self, q: UsageQuery, *, all_sources: bool = False) -> Iterator[UsageRecord]:
        """Matching events in finish order (ties by event id)."""
        where, params = queries.where(q, None if all_sources else q.source)
        sql = (f"SELECT {', '.join(FIELDS)} FROM usage_events{where}"
               " ORDER BY finished_at, event_id")
        cur = self._execute(sql, params)
        while batch := cur.fetchmany(1000):
            for row in batch:
                yield from_row(row)

    def requests_finished_in(self, q: UsageQuery) -> list[UsageRecord]:
        """Every record (both sources) of each request that has a record finished in the
        window: the other source's record may fall just outside it."""
        where, params = queries.where(q, None)
        sql = (f"SELECT {', '.join(FIELDS)} FROM usage_events WHERE request_id IN"
               f" (SELECT request_id FROM usage_events{where}) ORDER BY request_id, event_id")
        return [from_row(r) for r in self._execute(sql, params).fetchall()]
