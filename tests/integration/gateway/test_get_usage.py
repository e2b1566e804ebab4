"""A tenant reads its own usage through the public API (GetUsage), over gRPC and through the
Python SDK: the real gateway and a real meter, scoped by the API key's tenant."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.integration.gateway.fakes import MODEL
from tests.integration.gateway.test_gateway_with_fakes import auth, code_of, wait_for
from tokenserve.client import (AsyncClient, AuthenticationError, Client, InvalidRequestError,
                               PermissionDeniedError, UsageRow)
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


def test_the_sdk_reads_usage_as_typed_rows(gateway, key):
    with Client(gateway.target, key, timeout=20) as c:
        for rid in ("gu-sdk-1", "gu-sdk-2"):
            c.generate_text("a b c", max_tokens=2, request_id=rid, app="sdk")

        def sdk_row():
            rows = c.get_usage(group_by=["app", "model"])
            return next((r for r in rows if r.keys[0] == "sdk" and r.requests == 2), None)

        row = wait_for(sdk_row, timeout=20)
        assert row, "the SDK's requests never reached the meter"
        # fake tokenizer: 3 prompt tokens; fake engine: 1 cached token, 0.5 J per request
        assert row == UsageRow(keys=("sdk", MODEL), requests=2, prompt_tokens=6,
                               completion_tokens=4, cached_tokens=2, total_tokens=10,
                               energy_joules=1.0, tokens_per_joule=10.0,
                               energy_estimated=False)
        (total,) = c.get_usage(tenant_id="acme")  # no group_by: one row, no keys
        assert total.keys == () and total.requests >= 2
        hour = c.get_usage(group_by=["time"], bucket_seconds=3600)
        assert sum(r.requests for r in hour) == total.requests
        assert all(int(r.keys[0]) % 3600 == 0 for r in hour)
        assert c.get_usage(start=1.0, end=2.0) == []  # nothing finished in 1970
        with pytest.raises(PermissionDeniedError, match="not this key's tenant"):
            c.get_usage(tenant_id="vip")
        with pytest.raises(InvalidRequestError, match="end"):
            c.get_usage(start=20.0, end=10.0)
        with pytest.raises(ValueError, match="allowed"):
            c.get_usage(group_by=["colour"])
    with Client(gateway.target, "ts-wrong", timeout=20) as c:
        with pytest.raises(AuthenticationError):
            c.get_usage()


def test_the_async_sdk_reads_usage(gateway, key):
    async def run():
        async with AsyncClient(gateway.target, key, timeout=20) as c:
            await c.generate_text("a b", max_tokens=1, app="sdk-async")
            for _ in range(200):
                rows = await c.get_usage(group_by=["tenant", "tier", "app"])
                if any(r.keys[2] == "sdk-async" for r in rows):
                    break
                await asyncio.sleep(0.1)
            with pytest.raises(InvalidRequestError, match="twice"):
                await c.get_usage(group_by=["app", "app"])
            return rows

    rows = asyncio.run(run())
    assert {r.keys[:2] for r in rows} == {("acme", "free")}
    (mine,) = [r for r in rows if r.keys[2] == "sdk-async"]
    assert (mine.requests, mine.prompt_tokens, mine.completion_tokens) == (1, 2, 1)
