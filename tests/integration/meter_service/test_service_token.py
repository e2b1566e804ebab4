"""A meter started with $TOKENSERVE_METER_TOKEN: every MeterService call without that token
(none, a tenant's API key, a wrong token) is UNAUTHENTICATED; with it, and through tsctl
with the same variable, it works; health stays open."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controlplane.schema import generate_api_key
from controlplane.service_process import ServiceProcess
from tokenserve.meter.v1 import meter_pb2 as pb
from tokenserve.meter.v1 import meter_pb2_grpc
from tokenserve.runtime.ports import free_port
from tokenserve.runtime.service_token import METER_TOKEN_ENV

pytestmark = pytest.mark.slow  # starts a service process

TOKEN = "meter-token-0123456789abcdef"


@pytest.fixture(scope="module")
def meter(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("meter-token")
    port = free_port()
    proc = ServiceProcess("services.meter", ["--port", str(port), "--metrics-port", "-1",
                                             "--db", str(tmp / "meter.db")],
                          port, log_path=tmp / "meter.log", env={METER_TOKEN_ENV: TOKEN}).start()
    yield proc
    proc.stop()


def event(i: int) -> pb.UsageEvent:
    now = time.time()
    return pb.UsageEvent(event_id=f"t{i}", request_id=f"r{i}", source=pb.SOURCE_GATEWAY,
                         tenant_id="acme", model="m", model_version="v", tier="free",
                         prompt_tokens=1, completion_tokens=1, status="OK",
                         started_at=now - 2, finished_at=now - 1)


def calls(stub, md):
    return {
        "RecordUsage": lambda: stub.RecordUsage(pb.RecordUsageRequest(events=[event(9)]),
                                                metadata=md, timeout=10),
        "QueryUsage": lambda: stub.QueryUsage(pb.QueryUsageRequest(), metadata=md, timeout=10),
        "Reconcile": lambda: stub.Reconcile(pb.ReconcileRequest(), metadata=md, timeout=10),
        "ExportCsv": lambda: list(stub.ExportCsv(pb.QueryUsageRequest(), metadata=md,
                                                 timeout=10)),
        "ExportCloudEvents": lambda: list(stub.ExportCloudEvents(pb.QueryUsageRequest(),
                                                                 metadata=md, timeout=10)),
    }


@pytest.mark.parametrize("authorization", [None, "tenant key", f"Bearer {TOKEN}x",
                                           f"Basic {TOKEN}", f"Bearer {TOKEN[:-1]}"])
def test_every_rpc_without_the_token_is_unauthenticated(meter, authorization):
    if authorization == "tenant key":
        authorization = f"Bearer {generate_api_key('acme')[0]}"
    md = () if authorization is None else (("authorization", authorization),)
    with grpc.insecure_channel(meter.target) as ch:
        stub = meter_pb2_grpc.MeterServiceStub(ch)
        for name, call in calls(stub, md).items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert "needs its service token" in err.value.details()
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_with_the_token_every_rpc_works_and_tsctl_sends_it(meter):
    md = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(meter.target) as ch:
        for call in calls(meter_pb2_grpc.MeterServiceStub(ch), md).values():
            call()
    tsctl = [sys.executable, "-m", "controlplane.tsctl", "usage", "--meter", meter.target,
             "--since", "1h", "--json"]
    env = {k: v for k, v in os.environ.items() if k != METER_TOKEN_ENV}
    refused = subprocess.run(tsctl, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode != 0
    assert "needs its service token" in refused.stderr
    ok = subprocess.run(tsctl, capture_output=True, text=True, timeout=60,
                        env={**env, METER_TOKEN_ENV: TOKEN})
    assert ok.returncode == 0, ok.stderr
    assert '"requests": 1' in ok.stdout
