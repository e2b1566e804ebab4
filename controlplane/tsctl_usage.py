"""`tsctl usage`: what tenants used, from the meter (not etcd).

    tsctl usage --since 24h --group-by tenant,model        # table (or --json)
    tsctl usage export --since 30d --format cloudevents -o usage.jsonl
    tsctl usage reconcile --since 1h                        # gateway vs engine records

The meter is --meter (default $TOKENSERVE_METER or 127.0.0.1:50054); a meter that wants a
service token gets $TOKENSERVE_METER_TOKEN.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import datetime, timezone

import grpc

from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc
from tokenserve.runtime.channels import aio_channel
from tokenserve.runtime.errors import InvalidArgument, from_rpc_error
from tokenserve.runtime.tls import PLAINTEXT

GROUPS = {"tenant": meter_pb2.GROUP_BY_TENANT, "app": meter_pb2.GROUP_BY_APP,
          "model": meter_pb2.GROUP_BY_MODEL, "version": meter_pb2.GROUP_BY_VERSION,
          "tier": meter_pb2.GROUP_BY_TIER, "time": meter_pb2.GROUP_BY_TIME}
SOURCES = {"gateway": meter_pb2.SOURCE_GATEWAY, "engine": meter_pb2.SOURCE_ENGINE}
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
ROW_COLUMNS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens",
               "total_tokens", "energy_joules", "tokens_per_joule", "energy_estimated")


def parse_duration(text: str) -> float:
    """"90s", "30m", "1h", "35d" -> seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if m is None:
        raise InvalidArgument(f"--since must be a number with s, m, h or d (e.g. 1h), got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_time(text: str) -> float:
    """Unix seconds, or an ISO 8601 date/time (UTC unless it says otherwise)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidArgument(f"expected Unix seconds or an ISO date, got {text!r}") from None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


def window(a: argparse.Namespace, now: float | None = None) -> tuple[float, float]:
    """(start, end) in Unix seconds; 0 means unbounded."""
    now = time.time() if now is None else now
    if a.since and a.start:
        raise InvalidArgument("give --since or --start, not both")
    start = now - parse_duration(a.since) if a.since else parse_time(a.start) if a.start else 0.0
    end = parse_time(a.end) if a.end else 0.0
    return start, end


def query(a: argparse.Namespace) -> meter_pb2.QueryUsageRequest:
    start, end = window(a)
    groups = [g.strip() for g in (a.group_by or "").split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise InvalidArgument(f"--group-by: unknown {', '.join(unknown)}; use {', '.join(GROUPS)}")
    return meter_pb2.QueryUsageRequest(
        tenant_id=a.tenant or "", start=start, end=end, group_by=[GROUPS[g] for g in groups],
        bucket_seconds=a.bucket, source=SOURCES[a.source])


def rows_as_dicts(groups: list[str], rows) -> list[dict]:
    out = []
    for r in rows:
        d = dict(zip(groups or [], r.keys))
        if "time" in d:
            d["time"] = datetime.fromtimestamp(int(d["time"]), timezone.utc).strftime(
                "%Y-%m-%dT%H:%M:%SZ")
        for c in ROW_COLUMNS:
            v = getattr(r, c)
            d[c] = round(v, 6) if isinstance(v, float) else v
        out.append(d)
    return out


def _window_args(p: argparse.ArgumentParser, default_meter: str | None) -> None:
    """On `usage` itself with defaults, and on each action with none (argparse.SUPPRESS), so
    flags given before the action are not reset by the action's defaults."""
    d = (lambda v: {"default": v}) if default_meter else (lambda v: {"default": argparse.SUPPRESS})
    p.add_argument("--meter", help="meter host:port (default: $TOKENSERVE_METER or"
                   " 127.0.0.1:50054)", **d(default_meter))
    p.add_argument("--since", help="window ending now, e.g. 1h, 30d", **d(None))
    p.add_argument("--start", help="window start: Unix seconds or ISO date (UTC)", **d(None))
    p.add_argument("--end", help="window end (exclusive)", **d(None))


def _filter_args(p: argparse.ArgumentParser, defaults: bool) -> None:
    d = (lambda v: {"default": v}) if defaults else (lambda v: {"default": argparse.SUPPRESS})
    p.add_argument("--tenant", help="one tenant only", **d(None))
    p.add_argument("--source", choices=tuple(SOURCES),
                   help="whose records: gateway (billed, default) or engine", **d("gateway"))
    p.add_argument("--group-by", help=f"comma-separated: {', '.join(GROUPS)}", **d(""))
    p.add_argument("--bucket", type=int, help="seconds per time bucket (with --group-by time;"
                   " default 3600)", **d(3600))


def add_usage_parser(sub, conn: argparse.ArgumentParser, default_meter: str) -> None:
    window_leaf = argparse.ArgumentParser(add_help=False)
    _window_args(window_leaf, None)
    filters_leaf = argparse.ArgumentParser(add_help=False)
    _filter_args(filters_leaf, False)
    p = sub.add_parser("usage", help="usage from the meter: table, export, reconcile",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       parents=[conn])
    _window_args(p, default_meter)
    _filter_args(p, True)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.add_parser("show", help="sums by group (the default)",
                       parents=[conn, window_leaf, filters_leaf])
    e = actions.add_parser("export", help="every event as CSV or CloudEvents JSON lines",
                           parents=[conn, window_leaf, filters_leaf])
    e.add_argument("--format", choices=("csv", "cloudevents"), default="csv")
    e.add_argument("-o", "--output", help="file to write (default: stdout)")
    actions.add_parser("reconcile", help="gateway vs engine records: missing and mismatched",
                       parents=[conn, window_leaf])


async def cmd_usage(a: argparse.Namespace, out) -> int:
    async with aio_channel(a.meter, token=getattr(a, "meter_token", None),
                           tls=getattr(a, "tls", PLAINTEXT)) as channel:
        stub = meter_pb2_grpc.MeterServiceStub(channel)
        try:
            if a.action == "reconcile":
                return await _reconcile(stub, a, out)
            if a.action == "export":
                return await _export(stub, a)
            groups = [g.strip() for g in (a.group_by or "").split(",") if g.strip()]
            resp = await stub.QueryUsage(query(a), timeout=a.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, context=f"meter {a.meter}") from None
    rows = rows_as_dicts(groups, resp.rows)
    out.emit(rows, table=rows, columns=(*groups, *ROW_COLUMNS))
    return 0


async def _export(stub, a: argparse.Namespace) -> int:
    call = (stub.ExportCloudEvents if a.format == "cloudevents" else stub.ExportCsv)(
        query(a), timeout=max(a.timeout, 300))
    dest = open(a.output, "w", encoding="utf-8") if a.output else sys.stdout
    try:
        async for chunk in call:
            dest.write(chunk.data)
    finally:
        if a.output:
            dest.close()
    return 0


async def _reconcile(stub, a: argparse.Namespace, out) -> int:
    start, end = window(a)
    resp = await stub.Reconcile(meter_pb2.ReconcileRequest(start=start, end=end),
                                timeout=max(a.timeout, 60))
    mismatches = [{"request_id": m.request_id, "kind": m.kind, "field": m.field or None,
                   "gateway": m.gateway_value or None, "engine": m.engine_value or None}
                  for m in resp.mismatches]
    drift = len({m["request_id"] for m in mismatches})
    if out.as_json:
        out.emit({"matched": resp.matched, "drift": drift, "mismatches": mismatches})
    else:
        print(f"matched: {resp.matched}  drift: {drift} request(s)")
        if mismatches:
            out.emit(mismatches, table=mismatches,
                     columns=("request_id", "kind", "field", "gateway", "engine"))
    return 0
