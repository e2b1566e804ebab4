"""The SQL of QueryUsage, from the events or from the hourly rollup; both give the same rows.

Each builder returns (sql, params) with `?` placeholders; store.Ledger runs them. A group's
aggregates are always (events, requests, prompt, completion, cached, joules, estimated),
so one `usage_rows` reads any of them.
"""
from __future__ import annotations

from services.meter import rollup
from services.meter.dialect import Dialect
from services.meter.usage import GroupBy, UsageQuery, UsageRow
from tokenserve.usage import Source

_LABELS = ("tenant_id", "app", "model", "model_version", "tier")


def sums(table: str = "") -> list[str]:
    """The aggregates of a group after its event and request counts (of `table`'s columns)."""
    p = f"{table}." if table else ""
    return [*(f"SUM({p}{c})" for c in rollup.SUM_COLUMNS[2:-1]), f"MAX({p}energy_estimated)"]


def where(q: UsageQuery, source: Source | None) -> tuple[str, list]:
    """usage_events rows of q's source (None: both), tenant and range."""
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


def grouped(aggregates: list[str], dims: list[str], table: str, where_sql: str) -> str:
    sql = f"SELECT {', '.join([*dims, *aggregates])} FROM {table}{where_sql}"
    if dims:
        order = ", ".join(str(i + 1) for i in range(len(dims)))
        sql += f" GROUP BY {order} ORDER BY {order}"
    return sql


def _event_dims(q: UsageQuery, d: Dialect) -> list[str]:
    return [d.bucket("finished_at", int(q.bucket_seconds)) if g is GroupBy.TIME else g.value
            for g in q.group_by]


def from_events(q: UsageQuery, d: Dialect) -> tuple[str, list]:
    w, params = where(q, q.source)
    return grouped(["COUNT(*)", "COUNT(DISTINCT request_id)", *sums()], _event_dims(q, d),
                   "usage_events", w), params


def from_rollup(q: UsageQuery, plan: rollup.Plan, d: Dialect) -> tuple[str, list]:
    """The rollup rows of the whole hours and the edges' events summed the same way (per
    rollup key, split requests left out), grouped together. split_counts adds the split
    requests."""
    clauses, params = ["source = ?"], [q.source.value]
    if q.tenant_id:
        clauses.append("tenant_id = ?")
        params.append(q.tenant_id)
    for clause, bound in (("hour >= ?", plan.start_hour), ("hour < ?", plan.end_hour)):
        if bound is not None:
            clauses.append(clause)
            params.append(bound)
    parts = [f"SELECT {', '.join(_LABELS)}, hour, {', '.join(rollup.SUM_COLUMNS)}"
             f" FROM usage_hourly WHERE {' AND '.join(clauses)}"]
    tenant = " AND e.tenant_id = ?" if q.tenant_id else ""
    for lo, hi in plan.edges:
        parts.append(
            f"SELECT {', '.join('e.' + c for c in _LABELS)},"
            f" {d.bucket('e.finished_at', rollup.HOUR)}, COUNT(*),"
            " COUNT(DISTINCT CASE WHEN s.request_id IS NULL THEN e.request_id END),"
            f" {', '.join(sums('e'))} FROM usage_events e LEFT JOIN usage_split_requests s"
            " ON s.request_id = e.request_id AND s.source = e.source"
            f" WHERE e.source = ?{tenant} AND e.finished_at >= ? AND e.finished_at < ?"
            " GROUP BY 1, 2, 3, 4, 5, 6")
        params += [q.source.value, *([q.tenant_id] if q.tenant_id else []), lo, hi]
    bucket = int(q.bucket_seconds)
    dims = [f"(hour / {bucket}) * {bucket}" if g is GroupBy.TIME else g.value
            for g in q.group_by]
    return grouped(["SUM(events)", "SUM(requests)", *sums()], dims,
                   f"({' UNION ALL '.join(parts)}) u", ""), params


def split_ids(q: UsageQuery) -> tuple[str, list]:
    """The split requests of q's source that may have records in its range."""
    clauses, params = ["source = ?"], [q.source.value]
    if q.start is not None:
        clauses.append("last_hour >= ?")
        params.append(rollup.floor_to(q.start, rollup.HOUR))
    if q.end is not None:
        clauses.append("first_hour < ?")
        params.append(q.end)
    return "SELECT request_id FROM usage_split_requests WHERE " + " AND ".join(clauses), params


def split_counts(q: UsageQuery, d: Dialect) -> tuple[str, list]:
    """Distinct requests per group among request ids `{in}` a list (Dialect.rows_in)."""
    w, params = where(q, q.source)
    return grouped(["COUNT(DISTINCT request_id)"], _event_dims(q, d), "usage_events",
                   w + " AND {in}"), params


def usage_rows(rows, n: int, split: dict[tuple, int]) -> list[UsageRow]:
    """UsageRows from (n group keys, events, requests, prompt, completion, cached, joules,
    estimated); `split` adds requests per group."""
    out = []
    for r in rows:
        if not r[n]:  # no events: the total row of an empty range
            continue
        keys = tuple(str(k) for k in r[:n])
        out.append(UsageRow(
            keys=keys, requests=int(r[n + 1]) + split.get(keys, 0),
            prompt_tokens=int(r[n + 2] or 0), completion_tokens=int(r[n + 3] or 0),
            cached_tokens=int(r[n + 4] or 0), energy_joules=float(r[n + 5] or 0.0),
            energy_estimated=bool(r[n + 6] or 0)))
    return out
