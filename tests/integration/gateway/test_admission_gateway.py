"""Tier limits as a caller meets them: the real gateway process, a real etcd and meter (and a
real Redis for the shared store), FAKE tokenizer and engine (fakes.py: one token per word;
the engine emits max_tokens tokens 0.05 s apart)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from controlplane.schema import Tenant, Tier
from tests.integration.gateway.conftest import start_gateway
from tests.integration.gateway.fakes import MODEL, fake_engine
from tests.redis_fixture import redis_server  # noqa: F401  (pytest fixture)
from tokenserve.gateway.v1 import gateway_pb2 as pb
from tokenserve.meter.v1 import meter_pb2

from tests.integration.gateway.test_gateway_with_fakes import auth, meter_rows, wait_for


def tenant_on(control, gateway, name: str, **limits) -> str:
    """A tenant alone on its own tier (so tests never share a budget); returns its key once
    the gateway knows it."""
    values = dict(requests_per_second=1000, tokens_per_minute=100_000, daily_tokens=1_000_000,
                  max_concurrency=100, priority=1, max_tokens=100)
    values.update(limits)
    control.put(Tier(f"tier-{name}", **values), Tenant(name, name, f"tier-{name}"))
    key = control.issue_key(name)
    stub = gateway.stub()

    def known():
        try:
            return stub.CountTokens(pb.CountTokensRequest(prompt="x"), metadata=auth(key),
                                    timeout=5).count == 1
        except grpc.RpcError:
            return False

    assert wait_for(known)
    return key


def generate(stub, key, *, words=3, max_tokens=5, request_id="", timeout=30):
    """Runs one Generate; returns (code name, details, chunks, trailing metadata dict)."""
    call = stub.Generate(pb.GenerateRequest(prompt=" ".join(["w"] * words),
                                            max_tokens=max_tokens, request_id=request_id),
                         metadata=auth(key), timeout=timeout)
    try:
        chunks = list(call)
        return "OK", "", chunks, dict(call.initial_metadata())
    except grpc.RpcError as e:
        return e.code().name, e.details(), [], dict(e.trailing_metadata() or ())


def billed(meter_stub, tenant: str) -> int:
    rows = meter_stub.QueryUsage(meter_pb2.QueryUsageRequest(tenant_id=tenant), timeout=5).rows
    return sum(r.prompt_tokens + r.completion_tokens for r in rows)


def requests_metered(meter_stub, tenant: str) -> int:
    rows = meter_stub.QueryUsage(meter_pb2.QueryUsageRequest(tenant_id=tenant), timeout=5).rows
    return sum(r.requests for r in rows)


def flood(gateways, key, n, **kw):
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: generate(gateways[i % len(gateways)].stub(), key, **kw),
                             range(n)))


def check_budget_held(results, meter_stub, tenant, started, budget):
    ok = [r for r in results if r[0] == "OK"]
    refused = [r for r in results if r[0] != "OK"]
    assert ok and refused
    assert {r[0] for r in refused} == {"RESOURCE_EXHAUSTED"}
    assert {r[3]["limit"] for r in refused} == {"tpm"}
    used = sum(c[-1].usage.prompt_tokens + c[-1].usage.completion_tokens for _, _, c, _ in ok)
    elapsed = time.monotonic() - started
    # The bucket refills continuously: the budget plus what the elapsed time earned.
    assert used <= budget + elapsed * budget / 60
    assert wait_for(lambda: requests_metered(meter_stub, tenant) == len(ok))
    assert billed(meter_stub, tenant) == used


def test_fifty_concurrent_requests_never_bill_more_than_the_budget(gateway, control, meter_stub):
    key = tenant_on(control, gateway, "flood", tokens_per_minute=1000)
    started = time.monotonic()
    results = flood([gateway], key, 50, words=30, max_tokens=20)  # 50 tokens reserved each
    check_budget_held(results, meter_stub, "flood", started, 1000)


def test_two_gateways_sharing_redis_never_overspend(workdir, control, gateway, tokenizer, engine,
                                                    meter, meter_stub, redis_server):
    key = tenant_on(control, gateway, "shared", tokens_per_minute=1000)
    extra = ["--quota-store", redis_server.url]
    gws = [start_gateway(workdir, control.endpoint, tokenizer.target, meter.target,
                         [engine.target], name=f"gateway-redis-{i}", extra_args=extra)
           for i in range(2)]
    try:
        started = time.monotonic()
        results = flood(gws, key, 50, words=30, max_tokens=20)
        check_budget_held(results, meter_stub, "shared", started, 1000)
    finally:
        for gw in gws:
            gw.stop()


def test_success_carries_the_remaining_quota(gateway, control):
    key = tenant_on(control, gateway, "meta", tokens_per_minute=6000, requests_per_second=10)
    code, _, chunks, md = generate(gateway.stub(), key, words=10, max_tokens=20)
    assert code == "OK"
    assert md["x-ratelimit-limit-tokens"] == "6000"
    assert 5970 <= int(md["x-ratelimit-remaining-tokens"]) <= 5971  # 6000 - 30 reserved
    assert md["x-ratelimit-remaining-requests"] == "9"


def test_request_rate_burst_and_an_honest_retry_after(gateway, control):
    key = tenant_on(control, gateway, "rps", requests_per_second=3)
    stub = gateway.stub()
    assert [generate(stub, key, max_tokens=1)[0] for _ in range(3)] == ["OK"] * 3
    code, details, _, md = generate(stub, key, max_tokens=1)
    assert code == "RESOURCE_EXHAUSTED" and md["limit"] == "rps"
    assert "3 requests/second" in details
    wait_ms = int(md["retry-after-ms"])
    assert 0 < wait_ms <= 334
    time.sleep(wait_ms / 1000)
    assert generate(stub, key, max_tokens=1)[0] == "OK"


def test_concurrency_cap(gateway, control):
    key = tenant_on(control, gateway, "conc", max_concurrency=2)
    stub = gateway.stub()
    calls = [stub.Generate(pb.GenerateRequest(prompt="a", max_tokens=40), metadata=auth(key),
                           timeout=30) for _ in range(2)]
    for c in calls:
        next(c)  # both streaming
    code, details, _, md = generate(stub, key, max_tokens=1)
    assert code == "RESOURCE_EXHAUSTED" and md["limit"] == "concurrency"
    assert md["retry-after-ms"] == "unknown" and "2 concurrent requests" in details
    calls[0].cancel()
    assert wait_for(lambda: generate(stub, key, max_tokens=1)[0] == "OK")
    calls[1].cancel()


def test_a_cancelled_stream_gives_back_its_unused_reservation(gateway, control, engine,
                                                               meter_stub):
    key = tenant_on(control, gateway, "refund", tokens_per_minute=80)  # refills 1.3 tokens/s
    stub = gateway.stub()
    engine.servicer.delay = 0.3
    try:
        call = stub.Generate(pb.GenerateRequest(prompt="a b c", max_tokens=50,
                                                request_id="refund-1"),
                             metadata=auth(key), timeout=30)
        next(call)  # 53 reserved of 80
        code, _, _, md = generate(stub, key, words=3, max_tokens=50)
        assert code == "RESOURCE_EXHAUSTED" and md["limit"] == "tpm"
        call.cancel()
    finally:
        engine.servicer.delay = 0.05
    (row,) = wait_for(lambda: meter_rows(meter_stub, "refund-1"))
    used = int(row["prompt_tokens"]) + int(row["completion_tokens"])
    assert used < 10
    # Only what the cancelled request used stays spent: 53 - used came back.
    result = wait_for(lambda: (r := generate(stub, key, words=3, max_tokens=50))[0] == "OK" and r)
    assert result, "the unused reservation never came back"
    md = result[3]
    assert int(md["x-ratelimit-remaining-tokens"]) >= 80 - used - 53


def test_a_request_that_can_never_fit_is_invalid_argument(gateway, control):
    key = tenant_on(control, gateway, "small", tokens_per_minute=50)
    code, details, _, _ = generate(gateway.stub(), key, words=10, max_tokens=45)
    assert code == "INVALID_ARGUMENT"
    assert "max_tokens 45" in details and "tier-small tier's 50 tokens/minute" in details


def test_a_tier_change_applies_without_restart(gateway, control):
    key = tenant_on(control, gateway, "change", tokens_per_minute=100_000)
    stub = gateway.stub()
    assert generate(stub, key, words=10, max_tokens=10)[0] == "OK"
    control.put(Tier("tier-change", 1000, 15, 1_000_000, 100, 1, 100))
    assert wait_for(lambda: generate(stub, key, words=10, max_tokens=10)[0] == "INVALID_ARGUMENT")


def test_a_request_id_in_flight_cannot_be_reused(gateway, control):
    key = tenant_on(control, gateway, "dup")
    stub = gateway.stub()
    first = stub.Generate(pb.GenerateRequest(prompt="a", max_tokens=40, request_id="dup-1"),
                          metadata=auth(key), timeout=30)
    next(first)
    code, details, _, _ = generate(stub, key, request_id="dup-1")
    assert code == "ALREADY_EXISTS" and "dup-1" in details
    first.cancel()
    assert wait_for(lambda: generate(stub, key, max_tokens=1, request_id="dup-1")[0] == "OK")


def test_the_tiers_priority_reaches_the_engine(gateway, control, engine):
    key = tenant_on(control, gateway, "prio", priority=7)
    assert generate(gateway.stub(), key, request_id="prio-1")[0] == "OK"
    sent = next(r for r in engine.servicer.requests if r.request_id == "prio-1")
    assert (sent.priority, sent.tenant_id) == (7, "prio")


@pytest.mark.parametrize("fail_with, retried", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, True),   # engine full: another replica takes it
    (grpc.StatusCode.INVALID_ARGUMENT, False),    # the engine's own checks: the caller's error
])
def test_work_an_engine_refused_is_never_billed(workdir, control, gateway, tokenizer, meter,
                                                meter_stub, fail_with, retried):
    key = tenant_on(control, gateway, f"refused-{fail_with.name.lower()}")
    tenant = f"refused-{fail_with.name.lower()}"
    refusing, good = sorted([fake_engine(), fake_engine()], key=lambda s: s.target)
    refusing.servicer.fail_with = fail_with
    gw = start_gateway(workdir, control.endpoint, tokenizer.target, meter.target,
                       [refusing.target], name=f"gateway-{tenant}")
    gw2 = start_gateway(workdir, control.endpoint, tokenizer.target, meter.target,
                        [refusing.target, good.target], name=f"gateway-{tenant}-2")
    try:
        code, details, _, _ = generate(gw.stub(), key, request_id=f"{tenant}-alone")
        assert code == fail_with.name and "fake engine refuses" in details
        code, _, chunks, _ = generate(gw2.stub(), key, request_id=f"{tenant}-two")
        assert code == ("OK" if retried else fail_with.name)
        if retried:
            assert len(good.servicer.requests) == 1
            assert wait_for(lambda: meter_rows(meter_stub, f"{tenant}-two"))
        time.sleep(1.0)  # anything spooled has reached the meter by now
        assert meter_rows(meter_stub, f"{tenant}-alone") == []
        assert requests_metered(meter_stub, tenant) == (1 if retried else 0)
    finally:
        gw.stop()
        gw2.stop()
        refusing.stop()
        good.stop()


def test_over_http_limits_are_429s_with_retry_after_and_quota_headers(gateway, control):
    """The same admission through the OpenAI front, as the `openai` package reports it."""
    import openai
    key = tenant_on(control, gateway, "http-rps", requests_per_second=1, tokens_per_minute=600)
    with openai.OpenAI(base_url=gateway.http_url, api_key=key, max_retries=0, timeout=30) as c:
        ok = c.completions.with_raw_response.create(model=MODEL, prompt="w w w", max_tokens=5)
        assert ok.headers["x-ratelimit-limit-tokens"] == "600"
        assert int(ok.headers["x-ratelimit-remaining-tokens"]) <= 600 - 8
        with pytest.raises(openai.RateLimitError) as refused:
            c.completions.create(model=MODEL, prompt="w w w", max_tokens=5)
    err = refused.value
    assert err.status_code == 429 and err.code == "rps"
    assert "requests/second" in err.message
    retry = int(err.response.headers["retry-after-ms"])
    assert 0 < retry <= 1000 and int(err.response.headers["retry-after"]) == 1
