"""The meter as a real process, called through its generated stub over loopback, on SQLite
and on a real PostgreSQL. One meter per backend serves the module; each test writes under
its own tenant (and reads only that tenant), so tests do not see each other's events."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import grpc
import pytest

from controlplane.schema import Tenant, Tier
from controlplane.service_process import ServiceProcess
from controlplane.store import ConfigStore
from tokenserve.runtime.ports import free_port
from tokenserve.meter.v1 import meter_pb2 as pb
from tokenserve.meter.v1 import meter_pb2_grpc

NOW = time.time()


def start_meter(tmp_path, db: str, *extra: str, name: str = "meter") -> ServiceProcess:
    port = free_port()
    return ServiceProcess("services.meter", ["--port", str(port), "--metrics-port", "-1",
                                             "--db", db, *extra],
                          port, log_path=tmp_path / f"{name}.log").start()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def meter(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("meter")
    db = (str(tmp / "meter.db") if request.param == "sqlite"
          else request.getfixturevalue("postgres_url_module"))
    proc = start_meter(tmp, db)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def stub(meter):
    with grpc.insecure_channel(meter.target) as ch:
        yield meter_pb2_grpc.MeterServiceStub(ch)


_TENANT = ["acme"]


@pytest.fixture(autouse=True)
def tenant(request) -> str:
    """This test's own tenant id (ev() uses it unless told otherwise)."""
    _TENANT[0] = f"t-{uuid.uuid4().hex[:10]}"
    return _TENANT[0]


def ev(event_id, request_id, source=pb.SOURCE_GATEWAY, **kw):
    base = dict(tenant_id=_TENANT[0], app="bot", model="m", model_version="v1", tier="free",
                prompt_tokens=10, completion_tokens=4, status="OK",
                started_at=NOW - 61, finished_at=NOW - 60)
    base.update(kw)
    # ids are made unique per test the same way, so a shared ledger keeps tests apart
    t = _TENANT[0]
    return pb.UsageEvent(event_id=f"{t}-{event_id}" if event_id else "",
                         request_id=f"{t}-{request_id}", source=source, **base)


def record(stub, *events):
    return stub.RecordUsage(pb.RecordUsageRequest(events=list(events)), timeout=30)


def refused(fn) -> str:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details()


def test_record_is_idempotent_and_survives_a_restart(meter, stub, tenant):
    r = record(stub, ev("e1", "r1"), ev("e2", "r2"), ev("e1", "r1"))
    assert (r.accepted, r.duplicates) == (2, 1)
    meter.stop()
    meter.start()
    r = record(stub, ev("e2", "r2"), ev("e3", "r3"))
    assert (r.accepted, r.duplicates) == (1, 1)
    rows = stub.QueryUsage(pb.QueryUsageRequest(tenant_id=tenant)).rows
    assert [(x.requests, x.prompt_tokens) for x in rows] == [(3, 30)]


def test_query_groups_by_version_and_tier_with_energy(stub, tenant):
    record(stub, ev("g1", "r1", model_version="v1", tier="free", energy_joules=2.0),
           ev("g2", "r2", model_version="v2", tier="premium", completion_tokens=6,
              energy_joules=4.0, energy_estimated=True),
           ev("x1", "r1", source=pb.SOURCE_ENGINE, completion_tokens=9))
    rows = stub.QueryUsage(pb.QueryUsageRequest(
        tenant_id=tenant, group_by=[pb.GROUP_BY_VERSION, pb.GROUP_BY_TIER])).rows
    assert [(list(x.keys), x.requests, x.total_tokens, x.energy_joules, x.tokens_per_joule,
             x.energy_estimated) for x in rows] == [
        (["v1", "free"], 1, 14, 2.0, 7.0, False), (["v2", "premium"], 1, 16, 4.0, 4.0, True)]
    rows = stub.QueryUsage(pb.QueryUsageRequest(tenant_id=tenant, source=pb.SOURCE_ENGINE)).rows
    assert [x.completion_tokens for x in rows] == [9]


def test_reconcile_names_the_differing_field(stub, tenant):
    at = dict(started_at=NOW - 7201, finished_at=NOW - 7200)  # a window of its own
    record(stub, ev("g1", "same", **at), ev("x1", "same", source=pb.SOURCE_ENGINE, **at),
           ev("g2", "short", completion_tokens=4, **at),
           ev("x2", "short", source=pb.SOURCE_ENGINE, completion_tokens=3, **at),
           ev("g3", "lonely", **at))
    r = stub.Reconcile(pb.ReconcileRequest(start=NOW - 7210, end=NOW - 7190))
    assert r.matched == 1
    assert [(m.request_id, m.kind, m.field, m.gateway_value, m.engine_value)
            for m in r.mismatches] == [(f"{tenant}-lonely", "missing_engine", "", "", ""),
                                       (f"{tenant}-short", "mismatch", "completion_tokens",
                                        "4", "3")]


def test_exports_csv_and_cloudevents(stub, tenant):
    record(stub, ev("e1", "r1", finished_at=NOW - 50), ev("e2", "r2", finished_at=NOW - 40))
    q = pb.QueryUsageRequest(tenant_id=tenant)
    lines = "".join(c.data for c in stub.ExportCsv(q)).splitlines()
    assert lines[0].split(",")[:2] == ["event_id", "request_id"]
    assert [ln.split(",")[0] for ln in lines[1:]] == [f"{tenant}-e1", f"{tenant}-e2"]
    events = [json.loads(ln) for ln in "".join(c.data for c in stub.ExportCloudEvents(q))
              .splitlines()]
    assert [(e["specversion"], e["id"], e["subject"], e["source"]) for e in events] == [
        ("1.0", f"{tenant}-e1", tenant, "tokenserve/meter/gateway"),
        ("1.0", f"{tenant}-e2", tenant, "tokenserve/meter/gateway")]
    assert events[0]["type"] == "dev.tokenserve.usage.v1"
    assert events[0]["time"].endswith("Z")
    assert events[0]["data"]["prompt_tokens"] == 10
    assert events[0]["data"]["request_id"] == f"{tenant}-r1"


@pytest.mark.parametrize("bad, named", [
    (lambda: ev("", "r"), "events[1].event_id must not be empty"),
    (lambda: ev("e", "r", prompt_tokens=-3), "events[1].prompt_tokens must be >= 0"),
    (lambda: ev("e", "r", app="a\x00b"), "events[1].app contains a NUL byte"),
    (lambda: ev("e", "r", model="m" * 257), "events[1].model is 257 characters"),
    (lambda: ev("e", "r", finished_at=NOW - 40 * 86400, started_at=0),
     "events[1].finished_at"),
    (lambda: ev("e", "r", finished_at=NOW + 3600), "events[1].finished_at"),
    (lambda: ev("e", "r", source=pb.SOURCE_UNSPECIFIED), "events[1].source"),
    (lambda: ev("e", "r", source=7), "events[1].source"),
])
def test_a_bad_event_refuses_its_whole_batch_naming_index_and_field(stub, tenant, bad, named):
    details = refused(lambda: record(stub, ev("good-1", "g1"), bad(), ev("good-2", "g2")))
    assert named in details
    assert list(stub.QueryUsage(pb.QueryUsageRequest(tenant_id=tenant)).rows) == []


def test_oversized_batch_is_refused_and_nothing_is_stored(stub, tenant):
    details = refused(lambda: record(stub, *[ev(f"e{i}", f"r{i}") for i in range(10_001)]))
    assert "10000" in details
    assert list(stub.QueryUsage(pb.QueryUsageRequest(tenant_id=tenant)).rows) == []


def test_bad_query_is_invalid_argument(stub):
    refused(lambda: stub.QueryUsage(pb.QueryUsageRequest(start=20, end=10)))
    details = refused(lambda: stub.QueryUsage(pb.QueryUsageRequest(
        group_by=[pb.GROUP_BY_UNSPECIFIED])))
    assert "group_by[0]" in details


def test_with_a_control_plane_unknown_tenants_are_refused(tmp_path, etcd_session):
    etcd_session.clear()

    async def seed():
        async with ConfigStore([etcd_session.endpoint]) as store:
            await store.put(Tier("free", 10, 1000, 10_000, 4, 0, 64), actor="test")
            await store.put(Tenant("acme", "Acme", "free"), actor="test")

    asyncio.run(seed())
    meter = start_meter(tmp_path, str(tmp_path / "meter.db"),
                        "--etcd-endpoints", etcd_session.endpoint, "--config-snapshot",
                        str(tmp_path / "snap.json"))
    try:
        with grpc.insecure_channel(meter.target) as ch:
            stub = meter_pb2_grpc.MeterServiceStub(ch)
            details = refused(lambda: record(stub, ev("a", "a", tenant_id="acme"),
                                             ev("b", "b", tenant_id="ghost")))
            assert "events[1].tenant_id 'ghost' is not a configured tenant" in details
            assert record(stub, ev("a", "a", tenant_id="acme")).accepted == 1
    finally:
        meter.stop()
