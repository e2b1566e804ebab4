"""Admission decisions on plain data, with a hand-moved clock."""
from __future__ import annotations

import pytest

from services.gateway.admission import Limits, check_fits
from services.gateway.quota_store import MemoryQuotaStore
from tokenserve.runtime.errors import AlreadyExists, InvalidArgument, ResourceExhausted

LIMITS = Limits("standard", requests_per_second=5, tokens_per_minute=600, daily_tokens=10_000,
                max_concurrency=3)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def store(clock):
    return MemoryQuotaStore(clock)


def admit(store, rid, cost=10, limits=LIMITS):
    return store.admit_now("acme", limits, rid, cost, timeout=30)


def refusal(store, rid, cost=10, limits=LIMITS) -> ResourceExhausted:
    with pytest.raises(ResourceExhausted) as e:
        admit(store, rid, cost, limits)
    return e.value


def test_requests_per_second_allow_one_second_of_burst_then_refill(store, clock):
    held = [admit(store, f"r{i}")[0] for i in range(3)]
    for r in held:
        store.settle_now(r, 10)
    for i in range(3, 5):
        store.settle_now(admit(store, f"r{i}")[0], 10)
    e = refusal(store, "r5")
    assert e.limit == "rps" and e.retry_after == pytest.approx(0.2)
    assert "5 requests/second" in e.message and "standard tier" in e.message
    assert dict(e.metadata) == {"retry-after-ms": "200", "limit": "rps", "limit-remaining": "0"}
    clock.now += e.retry_after  # an honest retry-after: retrying then succeeds
    admit(store, "r5")


def test_a_rate_below_one_per_second_still_admits_one_request(store, clock):
    slow = Limits("trial", 0.5, 600, 10_000, 3)
    admit(store, "a", limits=slow)
    e = refusal(store, "b", limits=slow)
    assert e.retry_after == pytest.approx(2.0)
    clock.now += 2.0
    admit(store, "b", limits=slow)


def test_concurrency_counts_unsettled_requests(store, clock):
    held = [admit(store, f"r{i}")[0] for i in range(3)]
    e = refusal(store, "r3")
    assert e.limit == "concurrency" and e.retry_after is None
    assert dict(e.metadata)["retry-after-ms"] == "unknown"
    assert "3 concurrent requests" in e.message
    store.settle_now(held[0], 5)
    clock.now += 1
    admit(store, "r3")


def test_tokens_are_reserved_then_settled_to_what_was_used(store, clock):
    r, quota = admit(store, "a", cost=500)
    assert quota.remaining_tokens == 100 and quota.remaining_daily_tokens == 9_500
    e = refusal(store, "b", cost=200)  # 100 left: the reservation, not the use, counts
    assert e.limit == "tpm" and e.remaining == 100
    assert e.retry_after == pytest.approx(100 / 10)  # 600 tokens/minute refill 10/s
    store.settle_now(r, 150)  # used 150 of 500: 350 come back at once
    _, quota = admit(store, "b", cost=200)
    assert quota.remaining_tokens == 250


def test_no_window_edge_lets_a_tenant_spend_twice_its_minute(store, clock):
    """A fixed window would hand out a fresh 600 at the minute's edge; the bucket refills
    only what the elapsed time earns."""
    clock.now = 59.9
    store.settle_now(admit(store, "a", cost=600)[0], 600)
    clock.now = 60.1
    assert refusal(store, "b", cost=600).limit == "tpm"
    _, quota = admit(store, "c", cost=2)  # 0.2 s earned 2 tokens
    assert quota.remaining_tokens == 0


def test_daily_budget(store, clock):
    day = Limits("standard", 100, 600, 1_000, 50)
    for i in range(2):
        store.settle_now(admit(store, f"r{i}", cost=500, limits=day)[0], 500)
        clock.now += 60
    e = refusal(store, "r2", cost=500, limits=day)
    assert e.limit == "daily" and "1000 tokens/day" in e.message
    assert e.retry_after == pytest.approx((500 - 120 * 1000 / 86_400) / (1000 / 86_400))


def test_a_request_that_can_never_fit_is_invalid_not_retried():
    with pytest.raises(InvalidArgument) as e:
        check_fits(LIMITS, 50_000, 49_990)
    assert "max_tokens 49990" in e.value.message and "standard tier's 600 tokens/minute" in e.value.message
    check_fits(LIMITS, 600, 590)


def test_a_request_id_in_flight_cannot_be_reused_until_it_ends(store, clock):
    r, _ = admit(store, "same")
    with pytest.raises(AlreadyExists, match="'same' is already in flight"):
        admit(store, "same")
    store.settle_now(r, 10)
    admit(store, "same")


def test_refusals_take_nothing(store, clock):
    admit(store, "a", cost=550)
    for _ in range(3):
        refusal(store, "b", cost=100)
    _, quota = admit(store, "c", cost=50)
    assert quota.remaining_tokens == 0 and quota.remaining_requests == 3


def test_a_lowered_tier_limit_applies_to_the_next_request(store, clock):
    admit(store, "a", cost=100)
    lowered = Limits("standard", 5, 200, 10_000, 3)
    _, quota = admit(store, "b", cost=100, limits=lowered)  # 500 left, clamped to 200, -100
    assert quota.remaining_tokens == 100
    assert refusal(store, "c", cost=150, limits=lowered).limit == "tpm"


def test_tenants_do_not_share_budgets(store, clock):
    admit(store, "a", cost=600)
    store.admit_now("other", LIMITS, "a", 600, timeout=30)


def test_an_unsettled_reservation_expires_after_its_deadline_and_grace(store, clock):
    for i in range(3):
        admit(store, f"r{i}")
    clock.now += 30 + 61
    admit(store, "r3")


def test_the_fail_open_share_divides_every_limit():
    share = LIMITS.share(2)
    assert (share.requests_per_second, share.tokens_per_minute, share.daily_tokens,
            share.max_concurrency) == (2.5, 300, 5_000, 1)
    assert LIMITS.share(1) is LIMITS
