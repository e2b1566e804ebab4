"""`tsctl usage` against a real meter process: the table, --json, both exports, and
reconcile with the drift metric the meter exports."""
from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from tokenserve.runtime.ports import free_port
from controlplane.service_process import ServiceProcess
from tokenserve.meter.v1 import meter_pb2 as pb
from tokenserve.meter.v1 import meter_pb2_grpc

TSCTL = [sys.executable, "-m", "controlplane.tsctl"]
NOW = time.time()


@pytest.fixture(scope="module")
def meter(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tsctl-usage")
    port, metrics = free_port(), free_port()
    proc = ServiceProcess("services.meter", ["--port", str(port), "--metrics-port", str(metrics),
                                             "--db", str(tmp / "meter.db")],
                          port, log_path=tmp / "meter.log").start()
    proc.metrics_port = metrics
    ev = dict(model="m", tier="free", prompt_tokens=10, completion_tokens=5, status="OK",
              started_at=NOW - 120, finished_at=NOW - 100)
    with grpc.insecure_channel(proc.target) as ch:
        meter_pb2_grpc.MeterServiceStub(ch).RecordUsage(pb.RecordUsageRequest(events=[
            pb.UsageEvent(event_id="g1", request_id="r1", source=pb.SOURCE_GATEWAY,
                          tenant_id="acme", model_version="v1", energy_joules=3.0, **ev),
            pb.UsageEvent(event_id="e1", request_id="r1", source=pb.SOURCE_ENGINE,
                          tenant_id="acme", model_version="v1", energy_joules=3.0, **ev),
            pb.UsageEvent(event_id="g2", request_id="r2", source=pb.SOURCE_GATEWAY,
                          tenant_id="zeta", model_version="v2", **ev),
            pb.UsageEvent(event_id="e2", request_id="r2", source=pb.SOURCE_ENGINE,
                          tenant_id="zeta", model_version="v2",
                          **{**ev, "completion_tokens": 6}),
        ]), timeout=10)
    yield proc
    proc.stop()


def tsctl(meter, *args) -> subprocess.CompletedProcess:
    out = subprocess.run([*TSCTL, "usage", "--meter", meter.target, *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def test_table_and_json_group_by_tenant_and_version(meter):
    rows = json.loads(tsctl(meter, "--json", "--since", "1h", "--group-by", "tenant,version")
                      .stdout)
    assert [(r["tenant"], r["version"], r["requests"], r["total_tokens"], r["tokens_per_joule"])
            for r in rows] == [("acme", "v1", 1, 15, 5.0), ("zeta", "v2", 1, 15, 0)]
    table = tsctl(meter, "--group-by", "tenant").stdout.splitlines()
    assert table[0].split()[:3] == ["TENANT", "REQUESTS", "PROMPT_TOKENS"]
    assert [line.split()[0] for line in table[1:]] == ["acme", "zeta"]


def test_exports_csv_and_cloudevents(meter, tmp_path):
    text = tsctl(meter, "export", "--tenant", "acme").stdout
    assert [r["event_id"] for r in csv.DictReader(io.StringIO(text))] == ["g1"]
    tsctl(meter, "export", "--format", "cloudevents", "--source", "engine",
          "-o", str(tmp_path / "u.jsonl"))
    events = [json.loads(line) for line in (tmp_path / "u.jsonl").read_text().splitlines()]
    assert {(e["id"], e["subject"], e["source"]) for e in events} == {
        ("e1", "acme", "tokenserve/meter/engine"), ("e2", "zeta", "tokenserve/meter/engine")}
    assert {"specversion", "type", "id", "source", "subject", "time", "data"} <= set(events[0])


def test_reconcile_prints_the_drift_and_the_meter_exports_it(meter):
    report = json.loads(tsctl(meter, "reconcile", "--since", "1h", "--json").stdout)
    assert (report["matched"], report["drift"]) == (1, 1)
    assert report["mismatches"] == [{"request_id": "r2", "kind": "mismatch",
                                     "field": "completion_tokens", "gateway": "5",
                                     "engine": "6"}]
    text = tsctl(meter, "--since", "1h", "reconcile").stdout
    assert "drift: 1" in text and "completion_tokens" in text
    with urllib.request.urlopen(f"http://127.0.0.1:{meter.metrics_port}/metrics",
                                timeout=5) as r:
        metrics = r.read().decode()
    assert 'tokenserve_meter_reconcile_drift_records{kind="mismatch"} 1.0' in metrics
    assert 'tokenserve_meter_reconcile_drift_records{kind="missing_engine"} 0.0' in metrics


def test_a_bad_window_is_a_usage_error(meter):
    out = subprocess.run([*TSCTL, "usage", "--meter", meter.target, "--since", "yesterday"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--since" in out.stderr
