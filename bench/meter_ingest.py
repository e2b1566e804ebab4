"""Meter ingest and query: SQLite and PostgreSQL side by side, in the same run.

    python bench/meter_ingest.py [--runs 3] [--events 50000] [--stored 1000000]
        [--postgres postgresql://...]   (default: $TOKENSERVE_TEST_POSTGRES_URL)

For each backend a `python -m services.meter` process on loopback:
  - ingest: RecordUsage through a gRPC stub in batches of 500 (what the spool senders send),
    one sender after another, every batch durable before the next (SQLite synchronous=FULL,
    PostgreSQL commit); events/s and p50/p99 batch latency, median over --runs fresh ledgers.
  - query: --stored events over 30 days (50 tenants; one large tenant holds 10%) loaded into
    the ledger directly, then QueryUsage through gRPC: one tenant's month (typical tenant
    and the large one, grouped by model and version) and a whole-ledger group by tenant;
    p50 and p99 of 20 calls each.
Goals (issue 14): >= 20,000 events/s on SQLite, >= 10,000 on PostgreSQL, a tenant's month
query over 1 M events < 100 ms.
Writes bench/results/meter_ingest.json and bench/results/meter_ingest.png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from services.meter.store import Ledger  # noqa: E402
from controlplane.service_process import ServiceProcess  # noqa: E402
from tokenserve.meter.v1 import meter_pb2 as pb  # noqa: E402
from tokenserve.meter.v1 import meter_pb2_grpc  # noqa: E402
from tokenserve.runtime.ports import free_port  # noqa: E402
from tokenserve.usage import Source, UsageRecord, to_pb  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BATCH = 500
TENANTS = 50
MONTH = 30 * 86400
QUERY_CALLS = 20


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def record(i: int, now: float, rng: random.Random, spread: float = 3600.0) -> UsageRecord:
    finished = now - rng.random() * spread
    # tenant-0 holds 10% of the events, the other 49 share the rest
    tenant = 0 if rng.random() < 0.1 else rng.randrange(1, TENANTS)
    return UsageRecord(
        event_id=uuid.UUID(int=rng.getrandbits(128)).hex, request_id=f"req-{i}",
        source=Source.GATEWAY if i % 2 == 0 else Source.ENGINE, tenant_id=f"tenant-{tenant}",
        app=f"app-{i % 7}", model="smollm2-135m-instruct", model_version=("q4_1", "q8_0")[i % 2],
        tier=("free", "standard", "premium")[tenant % 3], prompt_tokens=rng.randrange(10, 2000),
        completion_tokens=rng.randrange(1, 500), cached_tokens=0, status="OK",
        finish_reason="stop", started_at=finished - 1.5, finished_at=finished,
        energy_joules=rng.random() * 5, energy_estimated=True)


def start_meter(db: str, tmp: Path, name: str) -> ServiceProcess:
    port = free_port()
    return ServiceProcess("services.meter", ["--port", str(port), "--metrics-port", "-1",
                                             "--db", db, "--log-level", "warning"],
                          port, log_path=tmp / f"{name}.log").start(timeout=60)


def ingest(target: str, n: int, seed: int) -> dict:
    rng, now = random.Random(seed), time.time()
    batches = [pb.RecordUsageRequest(events=[to_pb(record(i, now, rng))
                                             for i in range(s, min(n, s + BATCH))])
               for s in range(0, n, BATCH)]
    latencies = []
    with grpc.insecure_channel(target) as ch:
        stub = meter_pb2_grpc.MeterServiceStub(ch)
        stub.QueryUsage(pb.QueryUsageRequest(), timeout=30)  # warm the channel
        t0 = time.perf_counter()
        for b in batches:
            t = time.perf_counter()
            r = stub.RecordUsage(b, timeout=60)
            latencies.append(time.perf_counter() - t)
            assert r.accepted == len(b.events), r
        elapsed = time.perf_counter() - t0
    return {"events_per_s": n / elapsed, "batch_p50_ms": pct(latencies, 0.5) * 1000,
            "batch_p99_ms": pct(latencies, 0.99) * 1000}


def load(location: str, n: int) -> float:
    """Stores n events over the last 30 days directly through the ledger (setup, not timed
    as ingest); returns seconds taken."""
    rng, now = random.Random(7), time.time()
    led = Ledger.open(location)
    t0 = time.perf_counter()
    for s in range(0, n, 10_000):
        led.record([record(i, now, rng, spread=MONTH) for i in range(s, min(n, s + 10_000))])
    led.close()
    return time.perf_counter() - t0


def query_latency(target: str) -> dict:
    now = time.time()
    cases = {
        "tenant_month_ms": pb.QueryUsageRequest(
            tenant_id="tenant-7", start=now - MONTH, end=now,
            group_by=[pb.GROUP_BY_MODEL, pb.GROUP_BY_VERSION]),
        "large_tenant_month_ms": pb.QueryUsageRequest(
            tenant_id="tenant-0", start=now - MONTH, end=now,
            group_by=[pb.GROUP_BY_MODEL, pb.GROUP_BY_VERSION]),
        "all_tenants_month_ms": pb.QueryUsageRequest(
            start=now - MONTH, end=now, group_by=[pb.GROUP_BY_TENANT]),
    }
    out = {}
    with grpc.insecure_channel(target) as ch:
        stub = meter_pb2_grpc.MeterServiceStub(ch)
        for name, q in cases.items():
            stub.QueryUsage(q, timeout=120)  # warm caches
            times = []
            for _ in range(QUERY_CALLS):
                t = time.perf_counter()
                rows = stub.QueryUsage(q, timeout=120).rows
                times.append(time.perf_counter() - t)
            assert rows
            out[name.replace("_ms", "_p50_ms")] = pct(times, 0.5) * 1000
            out[name.replace("_ms", "_p99_ms")] = pct(times, 0.99) * 1000
            if name == "tenant_month_ms":
                out["tenant_month_events"] = sum(r.requests for r in rows)
    return out


def fresh_postgres(base: str) -> tuple[str, callable]:
    import psycopg

    schema = f"bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(base, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in base else "?"

    def drop():
        with psycopg.connect(base, autocommit=True) as c:
            c.execute(f"DROP SCHEMA {schema} CASCADE")

    return f"{base}{sep}options=-csearch_path%3D{schema}", drop


def backend_location(name: str, tmp: Path, pg_base: str, tag: str):
    if name == "sqlite":
        return str(tmp / f"{tag}.db"), (lambda: None)
    return fresh_postgres(pg_base)


def run_backend(name: str, a, tmp: Path) -> dict:
    runs = []
    for r in range(a.runs):
        location, drop = backend_location(name, tmp, a.postgres, f"ingest-{r}")
        meter = start_meter(location, tmp, f"{name}-{r}")
        try:
            runs.append(ingest(meter.target, a.events, seed=r))
        finally:
            meter.stop()
            drop()
        print(name, "ingest run", r, {k: round(v, 1) for k, v in runs[-1].items()}, flush=True)
    result = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
    result["ingest_runs"] = runs
    location, drop = backend_location(name, tmp, a.postgres, "query")
    try:
        result["load_seconds"] = load(location, a.stored)
        meter = start_meter(location, tmp, f"{name}-query")
        try:
            result.update(query_latency(meter.target))
        finally:
            meter.stop()
    finally:
        drop()
    print(name, "query", {k: round(v, 1) for k, v in result.items() if k.endswith("_ms")},
          flush=True)
    return result


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["backends"])
    res = summary["backends"]
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    ax[0].bar(names, [res[n]["events_per_s"] for n in names], color=["tab:blue", "tab:green"])
    for goal, n in ((20_000, "sqlite"), (10_000, "postgresql")):
        if n in names:
            i = names.index(n)
            ax[0].hlines(goal, i - 0.4, i + 0.4, colors="red", linestyles="--")
    ax[0].set_title(f"RecordUsage, batches of {BATCH}\nevents/s (red: goal)")
    ax[1].bar(names, [res[n]["batch_p99_ms"] for n in names], color=["tab:blue", "tab:green"])
    ax[1].set_title("batch latency p99 (ms)")
    keys = ("tenant_month_p50_ms", "large_tenant_month_p50_ms", "all_tenants_month_p50_ms")
    width = 0.25
    for j, k in enumerate(keys):
        ax[2].bar([i + (j - 1) * width for i in range(len(names))],
                  [res[n][k] for n in names], width, label=k.replace("_p50_ms", ""))
    ax[2].axhline(100, color="red", linestyle="--")
    ax[2].set_xticks(range(len(names)), names)
    ax[2].set_title(f"QueryUsage p50 over {summary['stored_events']:,} events (ms)")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--events", type=int, default=50_000)
    p.add_argument("--stored", type=int, default=1_000_000)
    p.add_argument("--postgres", default=os.environ.get("TOKENSERVE_TEST_POSTGRES_URL"))
    p.add_argument("--out", default="meter_ingest")
    a = p.parse_args()
    started = datetime.now(timezone.utc).isoformat()
    backends = {}
    with tempfile.TemporaryDirectory(prefix="meter-bench-") as d:
        tmp = Path(d)
        backends["sqlite"] = run_backend("sqlite", a, tmp)
        if a.postgres:
            backends["postgresql"] = run_backend("postgresql", a, tmp)
        else:
            print("no --postgres URL: PostgreSQL skipped", file=sys.stderr)
    summary = {
        "benchmark": "meter_ingest", "started": started, "runs": a.runs,
        "events_per_run": a.events, "batch": BATCH, "stored_events": a.stored,
        "tenants": TENANTS,
        "goals": {"sqlite_events_per_s": 20_000, "postgresql_events_per_s": 10_000,
                  "tenant_month_query_ms": 100},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "cpu_flags": cpu_flags(), "load_avg_at_end": os.getloadavg()},
        "note": "the meter, the client and PostgreSQL share the machine's cores (load_avg_at_end"
                " says how busy it was). Ingest figures are medians of runs.",
        "backends": backends,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps(summary, indent=2))
    plot(summary, RESULTS / f"{a.out}.png")
    print(json.dumps({n: {k: round(v, 1) for k, v in b.items() if not isinstance(v, list)}
                      for n, b in backends.items()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
