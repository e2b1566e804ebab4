"""The meter as a real process, called through its generated stub over loopback."""
from __future__ import annotations

import grpc
import pytest

from controlplane.service_process import ServiceProcess
from tokenserve.runtime.ports import free_port
from tokenserve.meter.v1 import meter_pb2 as pb
from tokenserve.meter.v1 import meter_pb2_grpc


@pytest.fixture
def meter(tmp_path):
    port = free_port()
    proc = ServiceProcess("services.meter", ["--port", str(port), "--metrics-port", "-1",
                                             "--db", str(tmp_path / "meter.db")],
                          port, log_path=tmp_path / "meter.log").start()
    yield proc
    proc.stop()


@pytest.fixture
def stub(meter):
    with grpc.insecure_channel(meter.target) as ch:
        yield meter_pb2_grpc.MeterServiceStub(ch)


def ev(event_id, request_id, source=pb.SOURCE_GATEWAY, **kw):
    base = dict(tenant_id="acme", app="bot", model="m", model_version="v1", tier="free",
                prompt_tokens=10, completion_tokens=4, status="OK",
                started_at=1_700_000_000.0, finished_at=1_700_000_001.0)
    base.update(kw)
    return pb.UsageEvent(event_id=event_id, request_id=request_id, source=source, **base)


def test_record_is_idempotent_and_survives_a_restart(meter, stub, tmp_path):
    r = stub.RecordUsage(pb.RecordUsageRequest(events=[ev("e1", "r1"), ev("e2", "r2"),
                                                       ev("e1", "r1")]))
    assert (r.accepted, r.duplicates) == (2, 1)
    meter.stop()
    meter.start()
    r = stub.RecordUsage(pb.RecordUsageRequest(events=[ev("e2", "r2"), ev("e3", "r3")]))
    assert (r.accepted, r.duplicates) == (1, 1)
    rows = stub.QueryUsage(pb.QueryUsageRequest(tenant_id="acme")).rows
    assert [(x.requests, x.prompt_tokens) for x in rows] == [(3, 30)]


def test_query_groups_and_selects_the_source(stub):
    stub.RecordUsage(pb.RecordUsageRequest(events=[
        ev("g1", "r1", app="a"), ev("g2", "r2", app="b", completion_tokens=6),
        ev("x1", "r1", source=pb.SOURCE_ENGINE, app="a", completion_tokens=9)]))
    rows = stub.QueryUsage(pb.QueryUsageRequest(group_by=[pb.GROUP_BY_APP])).rows
    assert [(list(x.keys), x.completion_tokens) for x in rows] == [(["a"], 4), (["b"], 6)]
    rows = stub.QueryUsage(pb.QueryUsageRequest(source=pb.SOURCE_ENGINE)).rows
    assert [x.completion_tokens for x in rows] == [9]


def test_reconcile_reports_mismatches(stub):
    stub.RecordUsage(pb.RecordUsageRequest(events=[
        ev("g1", "same"), ev("x1", "same", source=pb.SOURCE_ENGINE),
        ev("g2", "short", completion_tokens=4),
        ev("x2", "short", source=pb.SOURCE_ENGINE, completion_tokens=3),
        ev("g3", "lonely")]))
    r = stub.Reconcile(pb.ReconcileRequest())
    assert r.matched == 1
    assert [(m.request_id, m.kind, m.gateway_value, m.engine_value) for m in r.mismatches] == [
        ("lonely", "missing_engine", 4, 0), ("short", "completion_tokens", 4, 3)]


def test_export_streams_csv(stub):
    stub.RecordUsage(pb.RecordUsageRequest(events=[ev("e1", "r1"), ev("e2", "r2")]))
    text = "".join(c.data for c in stub.ExportCsv(pb.QueryUsageRequest(tenant_id="acme")))
    lines = text.splitlines()
    assert lines[0].split(",")[:2] == ["event_id", "request_id"]
    assert [ln.split(",")[0] for ln in lines[1:]] == ["e1", "e2"]


@pytest.mark.parametrize("event, field", [
    (ev("", "r"), "events[0].event_id"),
    (ev("e", "r", prompt_tokens=-3), "events[0].prompt_tokens"),
    (ev("e", "r", source=pb.SOURCE_UNSPECIFIED), "events[0].source"),
    (ev("e", "r", source=7), "events[0].source"),
])
def test_bad_events_are_invalid_argument_naming_the_field(stub, event, field):
    with pytest.raises(grpc.RpcError) as err:
        stub.RecordUsage(pb.RecordUsageRequest(events=[event]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


def test_oversized_batch_is_refused_and_nothing_is_stored(stub):
    events = [ev(f"e{i}", f"r{i}") for i in range(10_001)]
    with pytest.raises(grpc.RpcError) as err:
        stub.RecordUsage(pb.RecordUsageRequest(events=events))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "10000" in err.value.details()
    assert list(stub.QueryUsage(pb.QueryUsageRequest()).rows) == []


def test_bad_query_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.QueryUsage(pb.QueryUsageRequest(start=20, end=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.QueryUsage(pb.QueryUsageRequest(group_by=[pb.GROUP_BY_UNSPECIFIED]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "group_by[0]" in err.value.details()
