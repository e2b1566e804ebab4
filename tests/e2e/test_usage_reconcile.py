"""Two independent usage records, reconciled live: the whole suite as real processes (etcd,
meter, tokenizer, engine with its own usage spool, gateway), a short mixed load through the
public API, then Reconcile reports zero drift; a planted mismatch and a planted missing
record are found."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import pytest

from controlplane.launcher import DEMO_TENANT, Suite, SuitePorts
from tokenserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc

pytestmark = pytest.mark.slow

TSCTL = [sys.executable, "-m", "controlplane.tsctl"]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    s = Suite(tmp_path_factory.mktemp("suite"), SuitePorts.ephemeral(), say=lambda m: None)
    try:
        s.start(timeout=600)
    except Exception:
        s.stop()
        raise
    yield s
    s.stop()


def wait_for(predicate, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(0.1)
    return None


def reconcile(suite) -> dict:
    out = subprocess.run([*TSCTL, "usage", "--meter", suite.address("meter"), "reconcile",
                          "--since", "1h", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_mixed_load_reconciles_with_zero_drift_and_planted_drift_is_found(suite):
    key = suite.issue_key()
    md = (("authorization", f"Bearer {key}"),)
    with grpc.insecure_channel(suite.address("gateway")) as ch:
        api = gateway_pb2_grpc.InferenceServiceStub(ch)

        def generate(rid, max_tokens, **kw):
            return api.Generate(gateway_pb2.GenerateRequest(
                prompt="Tell me a long story about a lighthouse keeper.", max_tokens=max_tokens,
                request_id=rid), metadata=md, **kw)

        finished = list(generate("mix-finished", 8, timeout=120))
        assert finished[-1].usage.completion_tokens > 0
        stream = generate("mix-cancelled", 400, timeout=120)
        next(stream)  # the engine is generating: cancel mid-stream
        stream.cancel()
        try:  # the deadline passes mid-stream (or the model stops first: also consistent)
            list(generate("mix-deadline", 1000, timeout=3.0))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.RpcError) as refused:  # refused before any engine work
            list(generate("mix-refused", 10_000_000, timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        # the tenant's own view through the public API
        rows = wait_for(lambda: api.GetUsage(gateway_pb2.GetUsageRequest(), metadata=md,
                                             timeout=10).rows)
        assert rows and rows[0].requests >= 1

    ids = {"mix-finished", "mix-cancelled", "mix-deadline"}
    with grpc.insecure_channel(suite.address("meter")) as ch:
        meter = meter_pb2_grpc.MeterServiceStub(ch)

        def both_sources_arrived():
            csv = "".join(c.data for c in meter.ExportCsv(
                meter_pb2.QueryUsageRequest(source=meter_pb2.SOURCE_GATEWAY), timeout=10))
            csv += "".join(c.data for c in meter.ExportCsv(
                meter_pb2.QueryUsageRequest(source=meter_pb2.SOURCE_ENGINE), timeout=10))
            lines = [ln.split(",") for ln in csv.splitlines() if not ln.startswith("event_id")]
            seen = {(f[1], f[2]) for f in lines if f[1] in ids}
            return len(seen) == 2 * len(ids)

        assert wait_for(both_sources_arrived), "both records of every request never arrived"
        assert "mix-refused" not in "".join(
            c.data for c in meter.ExportCsv(meter_pb2.QueryUsageRequest(), timeout=10))

        report = reconcile(suite)
        assert report["mismatches"] == [] and report["drift"] == 0
        assert report["matched"] >= 3

        now = time.time()
        common = dict(tenant_id=DEMO_TENANT, model="m", model_version="v", prompt_tokens=5,
                      status="OK", started_at=now - 2, finished_at=now - 1)
        meter.RecordUsage(meter_pb2.RecordUsageRequest(events=[
            meter_pb2.UsageEvent(event_id="plant-g1", request_id="planted-missing",
                                 source=meter_pb2.SOURCE_GATEWAY, completion_tokens=3, **common),
            meter_pb2.UsageEvent(event_id="plant-g2", request_id="planted-mismatch",
                                 source=meter_pb2.SOURCE_GATEWAY, completion_tokens=3, **common),
            meter_pb2.UsageEvent(event_id="plant-e2", request_id="planted-mismatch",
                                 source=meter_pb2.SOURCE_ENGINE, completion_tokens=4, **common),
        ]), timeout=10)
    report = reconcile(suite)
    assert report["mismatches"] == [
        {"request_id": "planted-mismatch", "kind": "mismatch", "field": "completion_tokens",
         "gateway": "3", "engine": "4"},
        {"request_id": "planted-missing", "kind": "missing_engine", "field": None,
         "gateway": None, "engine": None}]
    assert report["drift"] == 2
