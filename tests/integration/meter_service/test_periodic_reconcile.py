"""The meter process reconciles on its own (--reconcile-interval-seconds): the drift gauge
on /metrics follows the ledger without anyone calling Reconcile, on SQLite and on a real
PostgreSQL; with 0 it stays unset."""
from __future__ import annotations

import time
import urllib.request
import uuid

import grpc
import pytest

from controlplane.service_process import ServiceProcess
from tokenserve.meter.v1 import meter_pb2 as pb
from tokenserve.meter.v1 import meter_pb2_grpc
from tokenserve.runtime.ports import free_port

NOW = time.time()
GAUGE = "tokenserve_meter_reconcile_drift_records"


def start_meter(tmp_path, db: str, interval: str) -> ServiceProcess:
    port, metrics = free_port(), free_port()
    proc = ServiceProcess("services.meter", ["--port", str(port), "--metrics-port", str(metrics),
                                             "--db", db, "--reconcile-interval-seconds",
                                             interval],
                          port, log_path=tmp_path / "meter.log").start()
    proc.metrics_port = metrics
    return proc


def metrics(meter) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{meter.metrics_port}/metrics",
                                timeout=5) as r:
        lines = r.read().decode().splitlines()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in lines if line.startswith("tokenserve_meter_"))}


def drift(meter) -> dict[str, float]:
    m = metrics(meter)
    return {kind: m.get(f'{GAUGE}{{kind="{kind}"}}')
            for kind in ("missing_engine", "missing_gateway", "mismatch")}


def wait_for(condition, meter, timeout=20.0):
    end = time.monotonic() + timeout
    while not condition(drift(meter)):
        assert time.monotonic() < end, f"drift gauge still {drift(meter)}"
        time.sleep(0.1)


def ev(event_id, request_id, source=pb.SOURCE_GATEWAY, **kw):
    base = dict(tenant_id="acme", model="m", model_version="v1", tier="free",
                prompt_tokens=10, completion_tokens=4, status="OK",
                started_at=NOW - 121, finished_at=NOW - 120)  # before the settle time
    base.update(kw)
    return pb.UsageEvent(event_id=event_id, request_id=request_id, source=source, **base)


def record(meter, *events):
    with grpc.insecure_channel(meter.target) as ch:
        meter_pb2_grpc.MeterServiceStub(ch).RecordUsage(
            pb.RecordUsageRequest(events=list(events)), timeout=30)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_drift_gauge_follows_the_ledger_without_a_reconcile_call(request, tmp_path,
                                                                    backend):
    db = (str(tmp_path / "meter.db") if backend == "sqlite"
          else request.getfixturevalue("postgres_url"))
    meter = start_meter(tmp_path, db, "0.2")
    try:
        r = uuid.uuid4().hex[:8]
        record(meter, ev(f"g1-{r}", f"ok-{r}"), ev(f"e1-{r}", f"ok-{r}", pb.SOURCE_ENGINE),
               ev(f"g2-{r}", f"lost-{r}"),
               ev(f"g3-{r}", f"diff-{r}", completion_tokens=4),
               ev(f"e3-{r}", f"diff-{r}", pb.SOURCE_ENGINE, completion_tokens=5))
        wait_for(lambda d: d == {"missing_engine": 1, "missing_gateway": 0, "mismatch": 1},
                 meter)
        record(meter, ev(f"e2-{r}", f"lost-{r}", pb.SOURCE_ENGINE))  # it arrives late
        wait_for(lambda d: d["missing_engine"] == 0 and d["mismatch"] == 1, meter)
        assert metrics(meter)["tokenserve_meter_reconcile_last_run_timestamp_seconds"] > NOW
    finally:
        meter.stop()


def test_interval_zero_leaves_the_gauge_to_reconcile_calls(tmp_path):
    meter = start_meter(tmp_path, str(tmp_path / "meter.db"), "0")
    try:
        record(meter, ev("g1", "lost"))
        time.sleep(1.0)  # what a 0.2 s interval would have used five times over
        assert drift(meter) == {"missing_engine": None, "missing_gateway": None,
                                "mismatch": None}
        assert metrics(meter)["tokenserve_meter_reconcile_last_run_timestamp_seconds"] == 0
    finally:
        meter.stop()
