"""The quota stores against a real Redis server: the same rules as in memory, exact across
several gateways, and a defined behaviour when Redis is gone."""
from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway import metrics
from services.gateway.admission import Limits
from services.gateway.quota_store import MemoryQuotaStore, RedisQuotaStore
from tests.redis_fixture import redis_server  # noqa: F401  (pytest fixture)
from tokenserve.runtime.errors import AlreadyExists, ResourceExhausted, Unavailable

LIMITS = Limits("standard", requests_per_second=1000, tokens_per_minute=1000,
                daily_tokens=100_000, max_concurrency=100)


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        s = MemoryQuotaStore()
    else:
        s = RedisQuotaStore(request.getfixturevalue("redis_server").url)
    yield s
    await s.close()


async def test_reserve_refuse_settle_and_reuse(store):
    r, quota = await store.admit("acme", LIMITS, "a", 700, 30)
    assert quota.remaining_tokens == 300
    with pytest.raises(AlreadyExists):
        await store.admit("acme", LIMITS, "a", 10, 30)
    with pytest.raises(ResourceExhausted) as e:
        await store.admit("acme", LIMITS, "b", 400, 30)
    assert e.value.limit == "tpm" and e.value.remaining == 300
    assert 5.9 < e.value.retry_after <= 6.0  # 100 tokens missing at 1000/60 per second
    await store.settle(r, 100)  # 600 unused come back
    _, quota = await store.admit("acme", LIMITS, "a", 400, 30)
    assert 499 <= quota.remaining_tokens <= 501  # 900 - 400, plus what elapsed time refilled


async def test_concurrency_slots_free_when_settled(store):
    two = Limits("free", 100, 10_000, 100_000, 2)
    held = [(await store.admit("acme", two, f"r{i}", 1, 30))[0] for i in range(2)]
    with pytest.raises(ResourceExhausted) as e:
        await store.admit("acme", two, "r2", 1, 30)
    assert e.value.limit == "concurrency" and dict(e.value.metadata)["retry-after-ms"] == "unknown"
    await store.settle(held[0], 1)
    await store.admit("acme", two, "r2", 1, 30)


async def test_two_gateways_on_one_redis_never_overspend(redis_server):
    """50 requests of 100 tokens, sent at once through two gateways' stores, against 1,000
    tokens/minute: at most what the budget plus its refill over the run allows."""
    a, b = RedisQuotaStore(redis_server.url), RedisQuotaStore(redis_server.url)
    started = time.monotonic()

    async def one(i):
        try:
            await (a if i % 2 else b).admit("acme", LIMITS, f"r{i}", 100, 30)
            return 1
        except ResourceExhausted:
            return 0

    admitted = sum(await asyncio.gather(*(one(i) for i in range(50))))
    elapsed = time.monotonic() - started
    assert 10 <= admitted * 100 <= 1000 + elapsed * 1000 / 60
    assert admitted <= 10 + int(elapsed * 1000 / 60 / 100)
    # A tenant served by one gateway alone still gets the whole budget.
    _, quota = await a.admit("solo", LIMITS, "x", 1000, 30)
    assert quota.remaining_tokens == 0
    await a.close()
    await b.close()


async def test_an_unsettled_reservation_expires(redis_server):
    store = RedisQuotaStore(redis_server.url, expiry_grace=0.0)
    one = Limits("free", 100, 10_000, 100_000, 1)
    await store.admit("acme", one, "dead-gateway", 1, 0.3)  # never settled
    with pytest.raises(ResourceExhausted):
        await store.admit("acme", one, "next", 1, 30)
    await asyncio.sleep(0.4)
    await store.admit("acme", one, "next", 1, 30)
    await store.close()


async def test_redis_down_fail_closed_refuses_with_unavailable(redis_server):
    store = RedisQuotaStore(redis_server.url, fail="closed")
    await store.admit("acme", LIMITS, "before", 10, 30)
    redis_server.kill()
    errors = metrics.QUOTA_STORE_ERRORS.labels("closed")._value.get()
    with pytest.raises(Unavailable, match="fail closed"):
        await store.admit("acme", LIMITS, "after", 10, 30)
    assert metrics.QUOTA_STORE_ERRORS.labels("closed")._value.get() == errors + 1
    await store.close()


async def test_redis_down_fail_open_admits_only_the_local_share(redis_server):
    store = RedisQuotaStore(redis_server.url, fail="open", live_gateways=lambda: 2)
    redis_server.kill()
    fallback = metrics.QUOTA_FALLBACK_ADMISSIONS._value.get()
    r, quota = await store.admit("acme", LIMITS, "a", 400, 30)  # share: 500 tokens/minute
    assert quota.limits.tokens_per_minute == 500 and quota.remaining_tokens == 100
    with pytest.raises(ResourceExhausted) as e:
        await store.admit("acme", LIMITS, "b", 400, 30)
    assert "500 tokens/minute" in e.value.message
    await store.settle(r, 0)
    await store.admit("acme", LIMITS, "b", 400, 30)
    assert metrics.QUOTA_FALLBACK_ADMISSIONS._value.get() == fallback + 2
    redis_server.start()  # back: Redis is used again once the pause has passed
    await asyncio.sleep(1.1)
    _, quota = await store.admit("acme", LIMITS, "c", 10, 30)
    assert quota.limits.tokens_per_minute == 1000
    await store.close()
