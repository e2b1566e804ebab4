"""tsctl's argument parser (kept apart from the command bodies in tsctl.py)."""
from __future__ import annotations

import argparse
from typing import Sequence

from controlplane import schema
from controlplane.tsctl_usage import add_usage_parser
from controlplane import top as top_view
from tokenserve.runtime.errors import InvalidArgument


def _connection_args(p: argparse.ArgumentParser, defaults: dict | None) -> None:
    """etcd/output flags; accepted before or after the subcommand."""
    d = defaults or {}
    kw = (lambda name: {"default": d[name]}) if defaults else (lambda name: {"default": argparse.SUPPRESS})
    g = p.add_argument_group("etcd connection and output")
    g.add_argument("--endpoints", help="comma-separated etcd host:port list "
                   "(default: $TOKENSERVE_ETCD or 127.0.0.1:2379)", **kw("endpoints"))
    g.add_argument("--user", help="etcd user", **kw("user"))
    g.add_argument("--password", help="etcd password (default: $TOKENSERVE_ETCD_PASSWORD)", **kw("password"))
    g.add_argument("--etcd-ca", help="CA certificate file; enables TLS", **kw("etcd_ca"))
    g.add_argument("--etcd-cert", help="client certificate file (mutual TLS)", **kw("etcd_cert"))
    g.add_argument("--etcd-key", help="client key file (mutual TLS)", **kw("etcd_key"))
    g.add_argument("--tls-ca", help="CA certificate of the services' TLS (top's GetInfo, usage's"
                   " meter); enables TLS to them", **kw("tls_ca"))
    g.add_argument("--tls-cert", help="client certificate for services that require one",
                   **kw("tls_cert"))
    g.add_argument("--tls-key", help="the private key of --tls-cert", **kw("tls_key"))
    g.add_argument("--timeout", type=float, help="seconds per etcd request (default 5)", **kw("timeout"))
    g.add_argument("--actor", help="who is making the change, for the audit log (default: $USER)",
                   **kw("actor"))
    g.add_argument("--json", action="store_true", help="machine-readable output", **kw("json"))


def build_parser(*, default_endpoints: str, default_actor: str,
                 default_password: str | None = None,
                 default_meter: str = "127.0.0.1:50054") -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="tsctl", description="Admin CLI for the tokenserve control plane (etcd).")
    _connection_args(top, {"endpoints": default_endpoints, "user": None, "password": default_password,
                           "etcd_ca": None, "etcd_cert": None, "etcd_key": None,
                           "tls_ca": None, "tls_cert": None, "tls_key": None, "timeout": 5.0,
                           "actor": default_actor, "json": False})
    conn = argparse.ArgumentParser(add_help=False)
    _connection_args(conn, None)
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def group(name: str, help: str) -> argparse._SubParsersAction:
        p = sub.add_parser(name, help=help, description=help)
        return p.add_subparsers(dest="action", required=True, metavar="ACTION")

    def leaf(parent: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
        return parent.add_parser(name, help=help, description=help.replace("%%", "%"),
                                 parents=[conn])

    t = group("tenant", "create, list, show, enable/disable tenants and their quota overrides")
    p = leaf(t, "create", "create a tenant")
    p.add_argument("id")
    p.add_argument("--name", help="display name (default: the id)")
    p.add_argument("--tier", required=True)
    p.add_argument("--disabled", action="store_true", help="create it disabled")
    leaf(t, "list", "list tenants")
    for name, help in (("show", "show a tenant and its keys"), ("disable", "refuse the tenant's keys"),
                       ("enable", "accept the tenant's keys again")):
        leaf(t, name, help).add_argument("id")
    p = leaf(t, "set-tier", "move a tenant to another tier")
    p.add_argument("id")
    p.add_argument("tier")
    p = leaf(t, "override", "set per-tenant limits over its tier, e.g. requests_per_second=20")
    p.add_argument("id")
    p.add_argument("limits", nargs="*", metavar="FIELD=VALUE",
                   help=f"fields: {', '.join(schema.TIER_LIMIT_FIELDS)}")
    p.add_argument("--clear", action="append", metavar="FIELD", help="remove one override (repeatable)")
    p.add_argument("--clear-all", action="store_true", help="remove every override first")

    k = group("key", "issue, revoke and list API keys")
    leaf(k, "issue", "issue a key for a tenant (printed once)").add_argument("tenant")
    leaf(k, "revoke", "revoke a key").add_argument("key", help="display prefix, sha256 hash, or the key")
    leaf(k, "list", "list keys (display prefixes only)").add_argument("--tenant")

    tr = group("tier", "set and show tiers")
    p = leaf(tr, "set", "update a tier's limits (create it when every limit is given)")
    p.add_argument("name")
    p.add_argument("--rps", type=_number, help="requests per second")
    for flag in ("tokens-per-minute", "daily-tokens", "max-concurrency", "priority", "max-tokens"):
        p.add_argument(f"--{flag}", type=int)
    leaf(tr, "show", "show tiers").add_argument("name", nargs="?")

    d = group("degrade", "set and show the degradation policy")
    p = leaf(d, "set", "change thresholds, the per-tier ladder or the token cap")
    p.add_argument("--queue-depth", type=int)
    p.add_argument("--ttft-p99", type=float, metavar="SECONDS")
    p.add_argument("--kv-use", type=float, metavar="FRACTION")
    p.add_argument("--power-vs-budget", type=float, metavar="RATIO")
    p.add_argument("--ladder", action="append", metavar="TIER=ACTION,ACTION",
                   help=f"actions by level: {', '.join(schema.DEGRADATION_ACTIONS)} (repeatable)")
    p.add_argument("--cap-max-tokens", type=int)
    p.add_argument("--margin", type=float, metavar="FRACTION",
                   help="hysteresis: a level is left once signals are below (1 - margin) x "
                        "its threshold ...")
    p.add_argument("--hold-seconds", type=float, metavar="SECONDS",
                   help="... for this long")
    on = p.add_mutually_exclusive_group()
    on.add_argument("--enable", dest="enabled", action="store_const", const=True,
                    help="turn the ladder on")
    on.add_argument("--disable", dest="enabled", action="store_const", const=False,
                    help="keep every gateway at level 0 (thresholds stay as they are)")
    leaf(d, "show", "show the degradation policy and the levels it makes")

    r = group("route", "split traffic between model versions")
    p = leaf(r, "set", "set version weights, e.g. q4_1=90 q8_0=10")
    p.add_argument("model")
    p.add_argument("weights", nargs="+", metavar="VERSION=WEIGHT")
    p.add_argument("--sticky", action=argparse.BooleanOptionalAction, default=None,
                   help="keep a tenant/session on one version")
    p = leaf(r, "canary", "give VERSION PERCENT%% of traffic; the others share the rest;"
                          " with a limit, gateways roll it back when it breaks it")
    p.add_argument("model")
    p.add_argument("version")
    p.add_argument("percent", type=int)
    p.add_argument("--max-error-rate", type=float, metavar="R",
                   help="roll back when the canary's error rate passes R (0-1) and the stable's")
    p.add_argument("--max-ttft-p99", type=float, metavar="S",
                   help="roll back when the canary's TTFT p99 passes S seconds and the stable's")
    p.add_argument("--window", type=float, metavar="S",
                   help=f"seconds the gateways compare over (default "
                        f"{schema.CanaryGuard.window_seconds:g})")
    p.add_argument("--min-requests", type=int, metavar="N",
                   help=f"canary requests needed in the window before judging (default "
                        f"{schema.CanaryGuard.min_requests})")
    p = leaf(r, "promote", "complete a rollout: VERSION gets 100%%, the guard is cleared")
    p.add_argument("model")
    p.add_argument("version")
    leaf(r, "rollback", "undo the route's last change").add_argument("model")
    leaf(r, "show", "show routes").add_argument("model", nargs="?")

    m = group("model", "model versions and their artifacts")
    p = leaf(m, "set", "add or change a model version")
    p.add_argument("name")
    p.add_argument("version")
    p.add_argument("--artifact", required=True, help="path, or builtin:<name>")
    p.add_argument("--max-context", type=int, required=True)
    p.add_argument("--default", action="store_true", help="make it the default version")
    leaf(m, "show", "show models")

    pw = group("power", "the power budget degradation compares against")
    leaf(pw, "set", "set the budget in watts").add_argument("watts", type=float)
    leaf(pw, "show", "show the budget")

    p = sub.add_parser("history", help="audit history of a key", parents=[conn])
    p.add_argument("key", help="e.g. tiers/free, tenants/acme, routes/<model>")
    p = sub.add_parser("rollback", help="restore a key as it was at a revision", parents=[conn])
    p.add_argument("key")
    p.add_argument("--to-revision", type=int, required=True)
    sub.add_parser("status", help="registered engines and gateways, config revision, last change",
                   parents=[conn])
    p = sub.add_parser("watch", help="print config changes as they happen", parents=[conn])
    p.add_argument("--count", type=int, default=0, help="exit after N changes (0: run until Ctrl-C)")
    add_usage_parser(sub, conn, default_meter)
    sub.add_parser("seed", help="write the default tiers, degradation, model and route where missing",
                   parents=[conn])
    top_view.add_parser(sub, conn)
    return top


def _number(text: str) -> float | int:
    """`20` -> 20, `2.5` -> 2.5 (so tables show what was typed)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    return int(value) if value.is_integer() and "." not in text else value


def parse_assignments(items: Sequence[str], *, number: bool = False,
                      integer: bool = False) -> dict[str, float | int | str]:
    """["a=1", "b=2"] -> {"a": 1, "b": 2}, with errors that quote the bad item."""
    out: dict = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise InvalidArgument(f"expected NAME=VALUE, got {item!r}")
        if number:
            try:
                num = float(value)
            except ValueError:
                raise InvalidArgument(f"{name}: expected a number, got {value!r}") from None
            if num.is_integer() and (integer or "." not in value):
                num = int(num)
            elif integer:
                raise InvalidArgument(f"{name}: expected an integer, got {value!r}")
            out[name] = num
        else:
            out[name] = value
    return out


def parse_ladder(items: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """["free=queue,reject"] -> {"free": ("queue", "reject")}."""
    raw = parse_assignments(items)
    return {tier: tuple(a.strip() for a in str(actions).split(",") if a.strip())
            for tier, actions in raw.items()}
