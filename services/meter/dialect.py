"""What differs between the ledger's two databases; the rest of its SQL is the same text.

Statements are written with `?` placeholders; `sql()` gives PostgreSQL's `%s`. PostgreSQL
takes a batch of rows as one statement over arrays sent binary (`%b`): measured on 500
events, 3.6 ms of client CPU against 9 for executemany with RETURNING. SQLite's
executemany loops in C.
"""
from __future__ import annotations

from typing import Iterator, Sequence

# Ids per `IN (...)` list on SQLite (its limit is 32,766 parameters a statement).
_IN_CHUNK = 500


class Dialect:
    def __init__(self, postgres: bool):
        self.postgres = postgres
        self.least, self.greatest = ("LEAST", "GREATEST") if postgres else ("MIN", "MAX")

    def sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.postgres else sql

    def bucket(self, column: str, seconds: int) -> str:
        """The start of `column`'s bucket of `seconds` (an int we own, never input text),
        the same floor as rollup.floor_to. Timestamps are >= 0, so truncation is floor."""
        if self.postgres:
            return f"CAST(FLOOR({column} / {seconds}) * {seconds} AS BIGINT)"
        return f"CAST({column} / {seconds} AS INTEGER) * {seconds}"

    def migration_texts(self, hour_seconds: int) -> dict[str, str]:
        """What migrations.statements fills in."""
        return {"hour": self.bucket("finished_at", hour_seconds),
                "without_rowid": "" if self.postgres else " WITHOUT ROWID"}

    def rows_in(self, cur, sql: str, column: str, values: list,
                params: Sequence = ()) -> Iterator[tuple]:
        """Rows of `sql` (`params` first) where its `{in}` is "`column` is one of
        `values`", however many values."""
        if not values:
            return
        if self.postgres:
            cur.execute(self.sql(sql.replace("{in}", f"{column} = ANY(?)")), (*params, values))
            yield from cur.fetchall()
            return
        for i in range(0, len(values), _IN_CHUNK):
            chunk = values[i:i + _IN_CHUNK]
            cur.execute(sql.replace("{in}", f"{column} IN ({', '.join('?' * len(chunk))})"),
                        (*params, *chunk))
            yield from cur.fetchall()


def unnest(types: Sequence[str]) -> str:
    """PostgreSQL: `SELECT * FROM unnest(...)` over one binary array parameter per column."""
    return f"SELECT * FROM unnest({', '.join(f'%b::{t}[]' for t in types)})"


def columns(rows, types: Sequence[str]) -> list[list]:
    """Rows -> one list per column, the parameters of `unnest(types)` (an array holds one
    Python type: a float8 column gets floats only, never an int among them)."""
    return [[float(v) for v in col] if t == "float8" else list(col)
            for t, col in zip(types, zip(*rows))]
