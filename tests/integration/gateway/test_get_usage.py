"""A tenant reads its own usage through the public API (GetUsage): the real gateway and a
real meter, scoped by the API key's tenant."""
from __future__ import annotations

import grpc
import pytest

from tests.integration.gateway.test_gateway_with_fakes import auth, code_of, wait_for
from tokenserve.gateway.v1 import gateway_pb2 as pb
from tokenserve.meter.v1 import meter_pb2


@pytest.fixture(scope="module")
def vip_key(control) -> str:
    return control.issue_key("vip")


def usage(stub, key, **kw):
    return stub.GetUsage(pb.GetUsageRequest(**kw), metadata=auth(key), timeout=10)


def test_a_tenant_sees_its_own_usage_only(gateway, key, vip_key):
    stub = gateway.stub()
    for k, app, rid in ((key, "bot", "gu-1"), (key, "batch", "gu-2"), (vip_key, "x", "gu-3")):
        list(stub.Generate(pb.GenerateRequest(prompt="a b", max_tokens=3, request_id=rid,
                                              app=app), metadata=auth(k), timeout=20))

    def acme_rows():
        rows = usage(stub, key, group_by=[meter_pb2.GROUP_BY_TENANT, meter_pb2.GROUP_BY_APP]).rows
        return rows if sum(r.requests for r in rows) >= 2 else None

    rows = wait_for(acme_rows, timeout=20)
    assert rows, "the usage never reached the meter"
    got = {tuple(r.keys): (r.requests, r.prompt_tokens, r.completion_tokens, r.total_tokens)
           for r in rows}
    assert {k: v for k, v in got.items() if k[1] in ("bot", "batch")} == {
        ("acme", "batch"): (1, 2, 3, 5), ("acme", "bot"): (1, 2, 3, 5)}
    assert {k[0] for k in got} == {"acme"}  # vip's request is not visible to acme's key
    own = usage(stub, key, tenant_id="acme", group_by=[meter_pb2.GROUP_BY_TENANT]).rows
    assert [tuple(r.keys) for r in own] == [("acme",)]


def test_another_tenants_id_is_permission_denied(gateway, key):
    code, details = code_of(lambda: usage(gateway.stub(), key, tenant_id="vip"))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "not this key's tenant" in details


def test_a_bad_window_is_invalid_argument_and_no_key_is_unauthenticated(gateway, key):
    code, details = code_of(lambda: usage(gateway.stub(), key, start=20.0, end=10.0))
    assert (code, "end" in details) == (grpc.StatusCode.INVALID_ARGUMENT, True)
    code, _ = code_of(lambda: gateway.stub().GetUsage(pb.GetUsageRequest(), timeout=10))
    assert code == grpc.StatusCode.UNAUTHENTICATED
