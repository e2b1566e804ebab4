"""tsctl: the tokenserve admin CLI over the etcd control plane.

    tsctl tenant create acme --name "Acme Corp" --tier standard
    tsctl key issue acme                       # prints the key once
    tsctl tier set free --rps 20
    tsctl route canary smollm2-135m-instruct q8_0 10
    tsctl history tiers/free
    tsctl rollback tiers/free --to-revision 12
    tsctl usage --since 24h --group-by tenant,model   # from the meter
    tsctl usage reconcile --since 1h

Tables by default, `--json` for scripts. Exit codes: 0 ok, 1 the operation failed (etcd
unreachable, conflict, not found, ...), 2 bad usage or invalid values. The audit actor is
--actor, else $USER.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any, Sequence

from controlplane import admin, schema
from controlplane import seed as seeding
from controlplane import top as top_view
from controlplane.etcd_client import EtcdOptions
from controlplane.store import ConfigStore
from controlplane.tsctl_args import build_parser, parse_assignments, parse_ladder
from controlplane.tsctl_usage import cmd_usage
from controlplane.watcher import ConfigWatcher
from tokenserve.runtime.service_token import METER_TOKEN_ENV
from tokenserve.runtime.errors import InvalidArgument, ServiceError
from tokenserve.runtime.logging import configure_logging
from tokenserve.runtime.tls import tls_from_args

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class Output:
    """Writes either aligned tables / `key: value` lines or JSON, to stdout."""

    def __init__(self, as_json: bool):
        self.as_json = as_json

    def emit(self, data: Any, *, table: list[dict] | None = None, columns: Sequence[str] = (),
             text: str | None = None) -> None:
        if self.as_json:
            print(json.dumps(data, indent=2, sort_keys=True, default=str))
        elif table is not None:
            print(render_table(table, columns))
        elif text is not None:
            print(text)
        else:
            print(render_fields(data))


def render_table(rows: list[dict], columns: Sequence[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def render_fields(data: dict, indent: str = "") -> str:
    lines = []
    for k, v in data.items():
        if isinstance(v, dict) and v:
            lines.append(f"{indent}{k}:")
            lines.append(render_fields(v, indent + "  "))
        else:
            lines.append(f"{indent}{k}: {_cell(v)}")
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (list, tuple)):
        return ",".join(_cell(x) for x in v) or "-"
    if isinstance(v, dict):
        return " ".join(f"{k}={_cell(x)}" for k, x in v.items()) or "-"
    return str(v)


# -- commands: each takes (store, args, out) and returns an exit code --------------------------

async def cmd_tenant(store: ConfigStore, a: argparse.Namespace, out: Output) -> int:
    if a.action == "create":
        rev = await admin.create_tenant(store, a.id, a.name or a.id, a.tier, actor=a.actor,
                                        enabled=not a.disabled)
        out.emit({"tenant": a.id, "revision": rev}, text=f"created tenants/{a.id} at revision {rev}")
    elif a.action == "list":
        rows = [schema.to_dict(v.document) for v in await store.list("tenants")]
        out.emit(rows, table=rows, columns=("id", "name", "tier", "enabled", "overrides"))
    elif a.action == "show":
        cur = await store.require(f"tenants/{a.id}")
        keys = [v.document for v in await store.list("keys") if v.document.tenant_id == a.id]
        data = {**schema.to_dict(cur.document), "revision": cur.mod_revision,
                "keys": [{"prefix": k.display_prefix, "revoked": k.revoked, "created_at": k.created_at}
                         for k in keys]}
        out.emit(data, text=None if out.as_json else render_fields(
            {k: v for k, v in data.items() if k != "keys"}) + "\nkeys:\n" + render_table(
            data["keys"], ("prefix", "created_at", "revoked")))
    elif a.action in ("disable", "enable"):
        rev = await admin.set_tenant_enabled(store, a.id, a.action == "enable", actor=a.actor)
        out.emit({"tenant": a.id, "revision": rev}, text=f"{a.action}d tenants/{a.id} at revision {rev}")
    elif a.action == "set-tier":
        rev = await admin.set_tenant_tier(store, a.id, a.tier, actor=a.actor)
        out.emit({"tenant": a.id, "revision": rev}, text=f"tenants/{a.id} now on tier {a.tier} (revision {rev})")
    elif a.action == "override":
        values = parse_assignments(a.limits, number=True)
        rev = await admin.set_tenant_overrides(store, a.id, values, clear=tuple(a.clear or ()),
                                               clear_all=a.clear_all, actor=a.actor)
        doc = (await store.require(f"tenants/{a.id}")).document
        out.emit({"tenant": a.id, "overrides": dict(doc.overrides), "revision": rev},
                 text=f"tenants/{a.id} overrides: {_cell(dict(doc.overrides))} (revision {rev})")
    return EXIT_OK


async def cmd_key(store: ConfigStore, a: argparse.Namespace, out: Output) -> int:
    if a.action == "issue":
        key, record, rev = await admin.issue_key(store, a.tenant, actor=a.actor)
        out.emit({"key": key, "tenant_id": record.tenant_id, "display_prefix": record.display_prefix,
                  "key_hash": record.key_hash, "revision": rev},
                 text=f"{key}\n\nThis is the only time the key is shown; store it now.\n"
                      f"tenant {record.tenant_id}, prefix {record.display_prefix}, revision {rev}")
    elif a.action == "revoke":
        record, rev = await admin.revoke_key(store, a.key, actor=a.actor)
        out.emit({"display_prefix": record.display_prefix, "key_hash": record.key_hash, "revision": rev},
                 text=f"revoked key {record.display_prefix}... of tenant {record.tenant_id} (revision {rev})")
    elif a.action == "list":
        keys = [v.document for v in await store.list("keys")
                if a.tenant is None or v.document.tenant_id == a.tenant]
        rows = [{"prefix": k.display_prefix, "tenant": k.tenant_id, "created_at": k.created_at,
                 "revoked": k.revoked, "hash": k.key_hash[:12]} for k in keys]
        out.emit(rows, table=rows, columns=("prefix", "tenant", "created_at", "revoked", "hash"))
    return EXIT_OK


TIER_FLAGS = {"rps": "requests_per_second", "tokens_per_minute": "tokens_per_minute",
              "daily_tokens": "daily_tokens", "max_concurrency": "max_concurrency",
              "priority": "priority", "max_tokens": "max_tokens"}
TIER_COLUMNS = ("name", *schema.TIER_LIMIT_FIELDS)


async def cmd_tier(store: ConfigStore, a: argparse.Namespace, out: Output) -> int:
    if a.action == "set":
        values = {f: getattr(a, flag) for flag, f in TIER_FLAGS.items() if getattr(a, flag) is not None}
        if not values:
            raise InvalidArgument("tier set: give at least one limit (--rps, --tokens-per-minute, ...)")
        created, rev = await admin.set_tier(store, a.name, values, actor=a.actor)
        out.emit({"tier": a.name, "created": created, "revision": rev},
                 text=f"{'created' if created else 'updated'} tiers/{a.name} at revision {rev}")
    else:
        docs = [v.document for v in await store.list("tiers") if a.name is None or v.document.name == a.name]
        if a.name and not docs:
            await store.require(f"tiers/{a.name}")
        rows = sorted((schema.to_dict(t) for t in docs), key=lambda t: (t["priority"], t["name"]))
        out.emit(rows, table=rows, columns=TIER_COLUMNS)
    return EXIT_OK


async def cmd_degrade(store: ConfigStore, a: argparse.Namespace, out: Output) -> int:
    if a.action == "set":
        th = {k: v for k, v in {"queue_depth": a.queue_depth, "ttft_p99_seconds": a.ttft_p99,
                                "kv_use_fraction": a.kv_use, "power_watts_vs_budget": a.power_vs_budget}.items()
              if v is not None}
        ladder = parse_ladder(a.ladder) if a.ladder else None
        settings = {k: v for k, v in {"hysteresis_margin": a.margin, "hold_seconds": a.hold_seconds,
                                      "enabled": a.enabled}.items() if v is not None}
        if not th and ladder is None and a.cap_max_tokens is None and not settings:
            raise InvalidArgument("degrade set: give a threshold, --ladder, --cap-max-tokens, "
                                  "--margin, --hold-seconds, --enable or --disable")
        rev = await admin.set_degradation(store, thresholds=th or None, ladder=ladder,
                                          cap_max_tokens=a.cap_max_tokens, settings=settings,
                                          actor=a.actor)
        out.emit({"revision": rev}, text=f"updated degradation at revision {rev}")
    else:
        cur = await store.require("degradation")
        budget = await store.get("power_budget")
        priority = {v.document.name: v.document.priority for v in await store.list("tiers")}
        data = {**schema.to_dict(cur.document), "revision": cur.mod_revision,
                "level_multiples": list(schema.DEGRADATION_LEVEL_MULTIPLES)}
        out.emit(data, text=render_fields({k: v for k, v in data.items() if k != "level_multiples"})
                 + "\n\n" + degradation_levels(cur.document, budget.document if budget else None,
                                               priority))
    return EXIT_OK


def degradation_levels(d: schema.Degradation, budget: schema.PowerBudget | None,
                       priority: dict[str, int]) -> str:
    """What each level means under `d`, as `tsctl degrade show` prints it (tiers lowest
    priority first)."""
    t = d.thresholds
    power = (f"{t.power_watts_vs_budget:g} x the {budget.watts:g} W budget" if budget
             else "off (no power budget: tsctl power set WATTS)")
    lines = ["signals and thresholds (level 1 at 1x, 2 at 1.5x, 3 at 2x; the worst signal wins):",
             f"  queue_depth       waiting requests per engine  {t.queue_depth}",
             f"  ttft_p99_seconds  worst engine's TTFT p99      {t.ttft_p99_seconds:g} s",
             f"  kv_use_fraction   KV blocks used, all engines  {t.kv_use_fraction:g}",
             f"  power             engines' summed watts        {power}",
             "levels:"]
    tiers = sorted(d.ladder, key=lambda t: (priority.get(t, 0), t))
    for level, m in enumerate(schema.DEGRADATION_LEVEL_MULTIPLES, start=1):
        acts = []
        for tier in tiers:
            act = d.action(tier, level)
            acts.append(f"{tier} {act}" + (f" {d.cap_max_tokens}" if act == "cap_max_tokens" else ""))
        lines.append(f"  {level} at {m:g}x: " + ", ".join(acts))
    lines.append(f"hysteresis: a level is left once every signal stays below "
                 f"{1 - d.hysteresis_margin:g} x its threshold for {d.hold_seconds:g} s"
                 + ("" if d.enabled else "\nDISABLED: every gateway stays at level 0"))
    return "\n".join(lines)


async def cmd_route(store: ConfigStore, a: argparse.Namespace, out: Output) -> int:
    if a.action == "set":
        weights = parse_assignments(a.weights, number=True, integer=True)
        rev = await admin.set_route(store, a.model, weights, sticky=a.sticky, actor=a.actor)
        out.emit({"model": a.model, "versions": weights, "revision": rev},
                 text=f"routes/{a.model}: {_cell(weights)} (revision {rev})")
    elif a.action == "canary":
        limits = admin.GuardLimits(a.max_error_rate, a.max_ttft_p99, a.window, a.min_requests)
        doc, rev = await admin.route_canary(store, a.model, a.version, a.percent,
                                            actor=a.actor, limits=limits)
        out.emit({**schema.to_dict(doc), "revision": rev}, text=_route_text(doc, rev))
    elif a.action == "promote":
        doc, rev = await admin.route_promote(store, a.model, a.version, actor=a.actor)
        out.emit({**schema.to_dict(doc), "revision": rev}, text=_route_text(doc, rev))
    elif a.action == "rollback":
        target, rev = await admin.route_rollback(store, a.model, actor=a.actor)
        doc = (await store.require(f"routes/{a.model}")).document
        out.emit({"model": a.model, "versions": dict(doc.versions), "restored_revision": target, "revision": rev},
                 text=f"routes/{a.model} restored to revision {target}: {_cell(dict(doc.versions))} (revision {rev})")
    else:
        routes = [v.document for v in await store.list("routes") if a.model is None or v.document.model == a.model]
        if a.model and not routes:
            await store.require(f"routes/{a.model}")
        rows = [{"model": r.model, "versions": dict(r.versions), "sticky": r.sticky,
                 "canary_guard": r.canary.describe() if r.canary else None} for r in routes]
        out.emit(rows, table=rows, columns=("model", "versions", "sticky", "canary_guard"))
    return EXIT_OK


def _route_text(doc: schema.Route, revision: int) -> str:
    text = f"routes/{doc.model}: {_cell(dict(doc.versions))} (revision {revision})"
    return text + (f"\n  guard: {doc.canary.describe()}" if doc.canary else "")


async def cmd_model(store: ConfigStore, a: argparse.Namespace, out: Output) -> int:
    if a.action == "set":
        rev = await admin.set_model_version(store, a.name, a.version, a.artifact, a.max_context,
                                            make_default=a.default, actor=a.actor)
        out.emit({"model": a.name, "version": a.version, "revision": rev},
                 text=f"models/{a.name} version {a.version} set (revision {rev})")
    else:
        rows = [{"model": m.name, "version": v, "artifact": mv.artifact, "max_context": mv.max_context,
                 "default": v == m.default_version}
                for m in (x.document for x in await store.list("models")) for v, mv in m.versions.items()]
        out.emit(rows, table=rows, columns=("model", "version", "artifact", "max_context", "default"))
    return EXIT_OK


async def cmd_power(store: ConfigStore, a: argparse.Namespace, out: Output) -> int:
    if a.action == "set":
        rev = await admin.set_power_budget(store, a.watts, actor=a.actor)
        out.emit({"watts": a.watts, "revision": rev}, text=f"power budget {a.watts:g} W (revision {rev})")
    else:
        cur = await store.require("power_budget")
        out.emit({"watts": cur.document.watts, "revision": cur.mod_revision})
    return EXIT_OK


async def cmd_history(store: ConfigStore, a: argparse.Namespace, out: Output) -> int:
    entries = await store.history(a.key)
    rows = [{"revision": e.revision, "at": e.at, "actor": e.actor, "action": e.action,
             "change": _diff(e.before, e.after), "detail": e.detail} for e in entries]
    out.emit([e.__dict__ for e in entries], table=rows,
             columns=("revision", "at", "actor", "action", "change", "detail"))
    return EXIT_OK


def _diff(before: dict | None, after: dict | None) -> str:
    if before is None:
        return "created"
    if after is None:
        return "deleted"
    changed = [f"{k}: {_cell(before.get(k))} -> {_cell(after.get(k))}"
               for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]
    return "; ".join(changed) or "(no change)"


async def cmd_rollback(store: ConfigStore, a: argparse.Namespace, out: Output) -> int:
    rev = await store.rollback(a.key, a.to_revision, actor=a.actor)
    out.emit({"key": a.key, "restored_revision": a.to_revision, "revision": rev},
             text=f"{a.key} rolled back to revision {a.to_revision} (new revision {rev})")
    return EXIT_OK


async def cmd_status(store: ConfigStore, a: argparse.Namespace, out: Output) -> int:
    st = await admin.cluster_status(store)
    if out.as_json:
        out.emit(st)
        return EXIT_OK
    last = st["last_change"]
    print(f"etcd:            {', '.join(st['endpoints'])}")
    print(f"config revision: {st['revision']}")
    if last:
        print(f"last change:     revision {last['revision']} {last['action']} {last['key']} by "
              f"{last['actor']} at {last['at']} ({last['age_seconds']} s ago)")
    print(f"\nengines ({len(st['engines'])}):")
    print(render_table(st["engines"], ("id", "endpoint", "model", "version", "capacity", "lease_ttl")))
    print(f"\ngateways ({len(st['gateways'])}):")
    print(render_table([{**g, "level": g["degradation_level"], "reason": g["degradation_reason"] or None}
                        for g in st["gateways"]], ("id", "endpoint", "level", "reason", "lease_ttl")))
    return EXIT_OK


async def cmd_seed(store: ConfigStore, a: argparse.Namespace, out: Output) -> int:
    """Writes each default document that is missing (an operator's edits stay)."""
    written = await seeding.seed(store, actor=a.actor)
    out.emit({"written": written}, text="seeded: " + (", ".join(written) or "nothing (all present)"))
    return EXIT_OK


async def cmd_watch(options: EtcdOptions, a: argparse.Namespace, out: Output) -> int:
    """Prints every config change as it is applied (Ctrl-C to stop)."""
    watcher = ConfigWatcher(options)
    done = asyncio.Event()
    seen = 0
    snap = await watcher.start()
    prev = dict(snap.documents)
    print(json.dumps({"revision": snap.revision, "event": "synced"}) if out.as_json
          else f"watching {', '.join(options.endpoints)} from revision {snap.revision}", flush=True)

    def changed(new) -> None:
        nonlocal prev, seen
        docs = dict(new.documents)
        for key in sorted(set(prev) | set(docs)):
            if prev.get(key) != docs.get(key):
                kind = "deleted" if key not in docs else "created" if key not in prev else "updated"
                line = ({"revision": new.revision, "key": key, "event": kind,
                         "document": schema.to_dict(docs[key]) if key in docs else None})
                print(json.dumps(line) if out.as_json else f"{new.revision:>8}  {kind:<8} {key}", flush=True)
        prev = docs
        seen += 1
        if a.count and seen >= a.count:
            done.set()

    watcher.on_change(changed)
    try:
        await done.wait()
    finally:
        await watcher.close()
    return EXIT_OK


COMMANDS = {"tenant": cmd_tenant, "key": cmd_key, "tier": cmd_tier, "degrade": cmd_degrade,
            "route": cmd_route, "model": cmd_model, "power": cmd_power, "history": cmd_history,
            "rollback": cmd_rollback, "status": cmd_status, "seed": cmd_seed}


async def run(a: argparse.Namespace) -> int:
    if a.command == "top" and a.suite_dir:
        top_view.use_suite_certificates(a)
    options = EtcdOptions(endpoints=a.endpoints, user=a.user, password=a.password, ca_file=a.etcd_ca,
                          cert_file=a.etcd_cert, key_file=a.etcd_key, timeout=a.timeout)
    out = Output(a.json)
    try:
        a.tls = tls_from_args(a)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
    if a.command == "watch":
        return await cmd_watch(options, a, out)
    if a.command == "usage":  # the meter, not etcd
        return await cmd_usage(a, out)
    if a.command == "top":
        return await top_view.cmd_top(options, a)
    async with ConfigStore(options) as store:
        return await COMMANDS[a.command](store, a, out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(default_endpoints=os.environ.get("TOKENSERVE_ETCD", "127.0.0.1:2379"),
                          default_actor=os.environ.get("USER") or os.environ.get("LOGNAME") or "unknown",
                          default_password=os.environ.get("TOKENSERVE_ETCD_PASSWORD"),
                          default_meter=os.environ.get("TOKENSERVE_METER", "127.0.0.1:50054"))
    args = parser.parse_args(argv)
    # never a flag: a flag's value shows in every process listing
    args.meter_token = os.environ.get(METER_TOKEN_ENV) or None
    configure_logging("tsctl", level="warning")  # library logs to stderr; stdout is the output
    try:
        return asyncio.run(run(args))
    except InvalidArgument as e:
        print(f"tsctl: {e.message}", file=sys.stderr)
        return EXIT_USAGE
    except ServiceError as e:
        print(f"tsctl: {e.message}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # never a stack trace at an operator; say what broke
        print(f"tsctl: unexpected error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
