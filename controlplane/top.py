"""`tsctl top`: a live view of the running suite, refreshed every second.

    tsctl top --metrics 127.0.0.1:9101 --metrics 127.0.0.1:9103     # live (Ctrl-C to stop)
    tsctl top --metrics 10.0.0.5:50053=10.0.0.5:9103 ...             # engine endpoint = its /metrics
    tsctl top --suite-dir var --once --json                          # one sample, for scripts

Where the numbers come from: engines and gateways registered in etcd (their leases), each
registered engine's GetInfo (running, waiting, KV blocks free), and each service's Prometheus
/metrics endpoint (`--metrics HOST:PORT`, repeatable, or every port `tokenserve up` wrote to
<suite-dir>/up.json). Rates and latency percentiles are taken over the interval between two
scrapes; a percentile with no observation in the interval is taken since the process started
(`ttft_window` / `itl_window`: "start"). With `--suite-dir` of `tokenserve up --tls`, the
suite's certificate (up.json names it) reaches etcd and the engines unless flags say otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from controlplane.etcd_client import EtcdOptions
from controlplane.store import ConfigStore
from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tokenserve.runtime.channels import aio_channel
from tokenserve.runtime.errors import InvalidArgument
from tokenserve.runtime.tls import PLAINTEXT, TlsConfig

# (metric name, label items) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def add_parser(sub: argparse._SubParsersAction, conn: argparse.ArgumentParser) -> None:
    p = sub.add_parser("top", parents=[conn], help="live view of engines and gateways: tokens/s, "
                       "TTFT and inter-token percentiles, queue, KV use, rejections by tier")
    p.add_argument("--metrics", action="append", default=[], metavar="[ENDPOINT=]HOST:PORT",
                   help="a service's /metrics address (repeatable); ENDPOINT= names the gRPC "
                        "endpoint an engine registered, where several engines share a host")
    p.add_argument("--suite-dir", help="a `tokenserve up` data dir: scrape every service it started")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one sample (two scrapes an interval "
                   "apart) and exit")


# -- pure: Prometheus samples -> rows ----------------------------------------------------------

def parse_samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sum(samples: Samples, name: str, **match: str) -> float:
    return sum(v for (n, labels), v in samples.items()
               if n == name and match.items() <= dict(labels).items())


def _by_label(samples: Samples, name: str, label: str, **match: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), v in samples.items():
        d = dict(labels)
        if n == name and match.items() <= d.items() and label in d:
            out[d[label]] = out.get(d[label], 0.0) + v
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts {upper bound: count}."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank, prev_bound, prev_count = q * total, 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if math.isinf(b):
                return prev_bound
            span = buckets[b] - prev_count
            return prev_bound + (b - prev_bound) * ((rank - prev_count) / span if span else 0)
        prev_bound, prev_count = b, buckets[b]
    return prev_bound


def _buckets(samples: Samples, name: str) -> dict[float, float]:
    return {float(le): v for le, v in _by_label(samples, f"{name}_bucket", "le").items()}


def _percentiles(before: Samples, after: Samples, name: str) -> tuple[float | None, float | None, str]:
    now = _buckets(after, name)
    delta = {b: now[b] - _buckets(before, name).get(b, 0.0) for b in now}
    use, window = (delta, "interval") if delta and max(delta.values()) > 0 else (now, "start")
    p50, p99 = histogram_quantile(0.5, use), histogram_quantile(0.99, use)
    return (None if p50 is None else round(p50, 4), None if p99 is None else round(p99, 4), window)


def _rate(before: Samples, after: Samples, name: str, seconds: float) -> float:
    return round(max(0.0, _sum(after, name) - _sum(before, name)) / seconds, 2) if seconds > 0 else 0.0


@dataclass
class EngineRow:
    metrics: str                 # the /metrics address
    endpoint: str = ""           # the gRPC endpoint registered in etcd ("" when not matched)
    model: str = ""
    version: str = ""
    tokens_per_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    ttft_window: str = "interval"  # "start": no first token in the interval, percentiles since start
    itl_window: str = "interval"
    running: int = 0
    waiting: int = 0
    kv_used_fraction: float | None = None


@dataclass
class GatewayRow:
    metrics: str
    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    ttft_p99_s: float | None = None
    degradation_level: float | None = None  # None: this gateway exports no level
    spool_events: int = 0
    rejections_by_tier: dict[str, int] = field(default_factory=dict)  # since start


def engine_row(address: str, before: Samples, after: Samples, seconds: float) -> EngineRow:
    ttft = _percentiles(before, after, "tokenserve_engine_time_to_first_token_seconds")
    itl = _percentiles(before, after, "tokenserve_engine_inter_token_latency_seconds")
    used = _sum(after, "tokenserve_engine_kv_blocks_used")
    free = _sum(after, "tokenserve_engine_kv_blocks_free")
    return EngineRow(
        metrics=address,
        tokens_per_s=_rate(before, after, "tokenserve_engine_generated_tokens_total", seconds),
        ttft_p50_s=ttft[0], ttft_p99_s=ttft[1], itl_p50_s=itl[0], itl_p99_s=itl[1],
        ttft_window=ttft[2], itl_window=itl[2],
        running=int(_sum(after, "tokenserve_engine_running_requests")),
        waiting=int(_sum(after, "tokenserve_engine_waiting_requests")),
        kv_used_fraction=round(used / (used + free), 4) if used + free else None)


def gateway_row(address: str, before: Samples, after: Samples, seconds: float) -> GatewayRow:
    level = [v for (n, _), v in after.items() if n == "tokenserve_gateway_degradation_level"]
    rejected = _by_label(after, "tokenserve_gateway_requests_total", "tier", code="RESOURCE_EXHAUSTED")
    return GatewayRow(
        metrics=address,
        requests_per_s=_rate(before, after, "tokenserve_gateway_requests_total", seconds),
        tokens_per_s=_rate(before, after, "tokenserve_gateway_tokens_streamed_total", seconds),
        ttft_p99_s=_percentiles(before, after, "tokenserve_gateway_time_to_first_token_seconds")[1],
        degradation_level=max(level) if level else None,
        spool_events=int(_sum(after, "tokenserve_gateway_usage_spool_events")),
        rejections_by_tier={t: int(v) for t, v in sorted(rejected.items())})


def kind_of(samples: Samples) -> str | None:
    names = {n for n, _ in samples}
    for kind in ("engine", "gateway", "tokenizer", "meter"):
        if any(n.startswith(f"tokenserve_{kind}_") for n in names):
            return kind
    return None


# -- I/O --------------------------------------------------------------------------------------

def scrape(address: str, timeout: float = 2.0) -> Samples | None:
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as r:
            return parse_samples(r.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def suite_metrics(suite_dir: str) -> list[str]:
    """--metrics values for every service `tokenserve up` started (engine paired with its port)."""
    path = Path(suite_dir) / "up.json"
    try:
        ports = json.loads(path.read_text())["ports"]
    except (OSError, ValueError, KeyError) as e:
        raise InvalidArgument(f"--suite-dir: cannot read {path} ({type(e).__name__}); "
                              f"is `tokenserve up --data-dir {suite_dir}` running?") from None
    return [(f"127.0.0.1:{ports[name.removesuffix('_metrics')]}=" if name == "engine_metrics" else "")
            + f"127.0.0.1:{port}" for name, port in sorted(ports.items()) if name.endswith("_metrics")]


def use_suite_certificates(a: argparse.Namespace) -> None:
    """Fills the etcd and service TLS flags left unset from <suite-dir>/up.json, where the
    suite runs with `--tls` (its certificate is the one every process presents)."""
    try:
        tls = json.loads((Path(a.suite_dir) / "up.json").read_text()).get("tls")
    except (OSError, ValueError):
        return  # suite_metrics says what is wrong with the folder
    if not tls:
        return
    for prefix in ("etcd", "tls"):
        if getattr(a, f"{prefix}_ca", None) is None and getattr(a, f"{prefix}_cert", None) is None:
            setattr(a, f"{prefix}_ca", tls["ca"])
            setattr(a, f"{prefix}_cert", tls["cert"])
            setattr(a, f"{prefix}_key", tls["key"])


def pair(metrics: list[str]) -> dict[str, str | None]:
    """["[ENDPOINT=]HOST:PORT", ...] -> {metrics address: engine endpoint or None}."""
    out = {}
    for value in metrics:
        endpoint, _, address = value.rpartition("=")
        out[address] = endpoint or None
    return out


def match(engines: list[EngineRow], endpoint: str, paired: dict[str, str | None]) -> EngineRow | None:
    """The scraped row of the engine registered at `endpoint`: named by --metrics ENDPOINT=, else
    the only unnamed engine row on the same host (None when there is no such single row)."""
    named = [e for e in engines if paired.get(e.metrics) == endpoint]
    if named:
        return named[0]
    host = endpoint.rpartition(":")[0]
    same = [e for e in engines if not e.endpoint and paired.get(e.metrics) is None
            and e.metrics.rpartition(":")[0] == host]
    return same[0] if len(same) == 1 else None


async def registrations(options: EtcdOptions) -> dict:
    """Engines and gateways registered in etcd, or an error string when etcd is unreachable."""
    try:
        async with ConfigStore(options) as store:
            engines = [v.document for v in await store.list("engines")]
            gateways = [v.document for v in await store.list("gateways")]
    except Exception as e:  # noqa: BLE001 - shown in the view; the rest keeps refreshing
        return {"error": f"etcd: {type(e).__name__}: {getattr(e, 'message', str(e))[:120]}",
                "engines": [], "gateways": []}
    return {"error": None, "engines": engines, "gateways": gateways}


async def engine_info(endpoint: str, tls: TlsConfig = PLAINTEXT) -> dict | None:
    try:
        async with aio_channel(endpoint, tls=tls) as ch:
            r = await engine_pb2_grpc.EngineServiceStub(ch).GetInfo(engine_pb2.GetInfoRequest(), timeout=2)
    except grpc.RpcError:
        return None
    return {"model": r.model, "version": r.version, "running": r.running, "waiting": r.waiting,
            "kv_used_fraction": round(1 - r.kv_blocks_free / r.kv_blocks_total, 4)
            if r.kv_blocks_total else None}


async def sample(options: EtcdOptions, paired: dict[str, str | None], before: dict[str, Samples],
                 seconds: float, tls: TlsConfig = PLAINTEXT) -> tuple[dict, dict[str, Samples]]:
    """One view: rows from the scrapes now compared with `before` (taken `seconds` ago)."""
    addresses = list(paired)
    after = {a: s for a in addresses if (s := await asyncio.to_thread(scrape, a)) is not None}
    reg = await registrations(options)
    engines, gateways = [], []
    for address, now in after.items():
        kind = kind_of(now)
        if kind == "engine":
            engines.append(engine_row(address, before.get(address, now), now, seconds))
        elif kind == "gateway":
            gateways.append(gateway_row(address, before.get(address, now), now, seconds))
    # registered engines: live load from GetInfo, on the row scraped from the same engine
    for r in reg["engines"]:
        info = await engine_info(r.endpoint, tls)
        row = match(engines, r.endpoint, paired)
        if row is None:
            row = EngineRow(metrics="")
            engines.append(row)
        row.endpoint, row.model, row.version = r.endpoint, r.model, r.version
        if info is not None:
            row.running, row.waiting = info["running"], info["waiting"]
            row.kv_used_fraction = info["kv_used_fraction"]
    view = {"at": round(time.time(), 3), "interval_s": round(seconds, 3), "etcd_error": reg["error"],
            "registered": {"engines": [r.endpoint for r in reg["engines"]],
                           "gateways": [r.endpoint for r in reg["gateways"]]},
            "unreachable": sorted(set(addresses) - set(after)),
            "engines": [asdict(e) for e in engines], "gateways": [asdict(g) for g in gateways],
            "totals": {"tokens_per_s": round(sum(e.tokens_per_s for e in engines), 2),
                       "waiting": sum(e.waiting for e in engines),
                       "running": sum(e.running for e in engines)}}
    return view, after


def render(view: dict) -> str:
    from controlplane.tsctl import render_table  # here: tsctl imports this module

    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f}"

    t = view["totals"]
    lines = [f"tokenserve top  {time.strftime('%H:%M:%S', time.localtime(view['at']))}  "
             f"tokens/s {t['tokens_per_s']}  running {t['running']}  waiting {t['waiting']}"
             + (f"  [{view['etcd_error']}]" if view["etcd_error"] else ""), "", "ENGINES"]
    lines.append(render_table([
        {"engine": e["endpoint"] or e["metrics"], "model": f"{e['model']}/{e['version']}".strip("/"),
         "tok/s": e["tokens_per_s"], "ttft p50/p99 ms": f"{ms(e['ttft_p50_s'])}/{ms(e['ttft_p99_s'])}",
         "itl p50/p99 ms": f"{ms(e['itl_p50_s'])}/{ms(e['itl_p99_s'])}", "run": e["running"],
         "wait": e["waiting"],
         "kv": "-" if e["kv_used_fraction"] is None else f"{e['kv_used_fraction']:.0%}"}
        for e in view["engines"]],
        ("engine", "model", "tok/s", "ttft p50/p99 ms", "itl p50/p99 ms", "run", "wait", "kv")))
    lines += ["", "GATEWAYS"]
    lines.append(render_table([
        {"gateway": g["metrics"], "req/s": g["requests_per_s"], "tok/s": g["tokens_per_s"],
         "ttft p99 ms": ms(g["ttft_p99_s"]),
         "level": "-" if g["degradation_level"] is None else int(g["degradation_level"]),
         "spool": g["spool_events"],
         "rejected by tier": " ".join(f"{k}={v}" for k, v in g["rejections_by_tier"].items()) or "-"}
        for g in view["gateways"]],
        ("gateway", "req/s", "tok/s", "ttft p99 ms", "level", "spool", "rejected by tier")))
    if view["unreachable"]:
        lines += ["", "unreachable: " + ", ".join(view["unreachable"])]
    return "\n".join(lines)


async def cmd_top(options: EtcdOptions, a: argparse.Namespace) -> int:
    paired = pair(list(a.metrics) + (suite_metrics(a.suite_dir) if a.suite_dir else []))
    before = {x: s for x in paired if (s := await asyncio.to_thread(scrape, x)) is not None}
    taken = time.monotonic()
    while True:
        await asyncio.sleep(a.interval)
        now = time.monotonic()
        view, before = await sample(options, paired, before, now - taken,
                                    getattr(a, "tls", PLAINTEXT))
        taken = now
        if a.once:
            print(json.dumps(view, indent=2, sort_keys=True) if a.json else render(view))
            return 0
        if a.json:  # one JSON document per line, for a script to follow
            print(json.dumps(view, sort_keys=True), flush=True)
        else:  # clear the screen and home the cursor, then draw the frame
            print("\x1b[2J\x1b[H" + render(view), flush=True)
