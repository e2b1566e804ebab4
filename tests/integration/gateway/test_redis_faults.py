"""Redis (the shared quota store) killed under two real gateway processes: `--quota-fail
closed` refuses with UNAVAILABLE naming the quota store; `--quota-fail open` admits each
gateway only up to its share (limit / live gateways), never unlimited; Redis back, the two
count in it together again. A real etcd, meter and Redis; FAKE tokenizer and engine (one
token per word; max_tokens tokens 0.05 s apart)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from aetcd import rpc

from tests.integration.gateway.conftest import start_gateway
from tests.integration.gateway.test_admission_gateway import generate, tenant_on
from tests.integration.gateway.test_gateway_with_fakes import wait_for
from tests.redis_fixture import redis_server  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.slow

BUDGET = 1200  # tokens/minute of the test tier; a request costs 30 prompt + 20 completion
COST = 50


def live_gateways(endpoint: str) -> int:
    prefix = b"/tokenserve/v1/gateways/"
    with grpc.insecure_channel(endpoint) as ch:
        resp = rpc.KVStub(ch).Range(rpc.RangeRequest(key=prefix, range_end=prefix[:-1] + b"0",
                                                     count_only=True), timeout=5)
    return resp.count


@pytest.fixture
def pair(request, workdir, control, tokenizer, engine, meter, redis_server):
    """Two gateways sharing redis_server, failing the way the test's param says."""
    fail = request.param
    gws = [start_gateway(workdir, control.endpoint, tokenizer.target, meter.target,
                         [engine.target], name=f"gateway-{fail}-{i}",
                         extra_args=["--quota-store", redis_server.url, "--quota-fail", fail])
           for i in range(2)]
    try:
        assert wait_for(lambda: live_gateways(control.endpoint) == 2)
        yield gws
    finally:
        for gw in gws:
            gw.stop()


def flood(gw, key, n):
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: generate(gw.stub(), key, words=30, max_tokens=20),
                             range(n)))


def admitted(results) -> int:
    return sum(r[0] == "OK" for r in results)


def key_known_to_both(control, pair, name: str) -> str:
    key = tenant_on(control, pair[0], name, tokens_per_minute=BUDGET)
    assert wait_for(lambda: generate(pair[1].stub(), key, words=1, max_tokens=1)[0] == "OK")
    return key


@pytest.mark.parametrize("pair", ["closed"], indirect=True)
def test_redis_down_fail_closed_refuses_with_unavailable_naming_the_quota_store(
        pair, control, redis_server):
    key = key_known_to_both(control, pair, "redis-closed")
    redis_server.kill()
    for gw in pair:
        for _ in range(3):
            code, details, _, _ = generate(gw.stub(), key, words=3, max_tokens=2)
            assert code == "UNAVAILABLE", (code, details)
            assert "quota store (Redis) is unreachable" in details
    redis_server.start()
    time.sleep(1.1)  # the store skips Redis for a second after a failure
    for gw in pair:
        assert wait_for(lambda: generate(gw.stub(), key, words=3, max_tokens=2)[0] == "OK", 10)


@pytest.mark.parametrize("pair", ["open"], indirect=True)
def test_redis_down_fail_open_admits_each_gateway_its_share_then_shares_again(
        pair, control, redis_server):
    key = key_known_to_both(control, pair, "redis-open")
    redis_server.kill()
    share = BUDGET // 2 // COST  # 2 live gateways: 600 tokens/minute each, 12 requests
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        per_gateway = list(pool.map(lambda gw: flood(gw, key, 2 * share), pair))
    elapsed = time.monotonic() - started
    for results in per_gateway:
        refill = int(elapsed * BUDGET / 2 / 60 / COST)
        assert share - 1 <= admitted(results) <= share + refill, [r[:2] for r in results]
        refused = [r for r in results if r[0] != "OK"]
        assert {r[0] for r in refused} == {"RESOURCE_EXHAUSTED"}
        assert all(f"{BUDGET // 2} tokens/minute" in r[1] for r in refused), refused[0][1]
    print(f"Redis down, fail open: admitted {[admitted(r) for r in per_gateway]} of"
          f" {2 * share} each (share {share})")

    redis_server.start()  # empty: the budget starts full, counted in Redis by both
    time.sleep(1.1)
    first = flood(pair[0], key, 3 * share)
    assert 2 * share - 1 <= admitted(first) <= 2 * share + 2, "one gateway gets the whole budget"
    refused = [r for r in first if r[0] != "OK"]
    assert refused and all(f"{BUDGET} tokens/minute" in r[1] for r in refused), refused[0][1]
    second = flood(pair[1], key, 5)  # what the first spent is spent for the second too
    assert admitted(second) <= 2, [r[:2] for r in second]
    print(f"Redis back: the first gateway admitted {admitted(first)}, the second then"
          f" {admitted(second)} of 5")
