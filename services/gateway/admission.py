"""Admission: may this tenant start this request now? Pure Python over plain data.

Four limits per tenant, from its effective tier (tier + overrides, live from the watch):

- requests per second: a token bucket holding one second of rate (at least one request);
- concurrent streams: requests admitted and not yet settled;
- tokens per minute and tokens per day: token buckets that refill continuously (a bucket has
  no window edge, so no tenant can spend twice its budget across one).

Tokens are reserve-then-settle. Admission reserves prompt + max_tokens from both token
buckets at once; `settle` gives back what the request did not use (refused or failed work
gives back everything). So while a request streams, nothing can take the tenant past its
budget, and the tenant is charged what the usage record bills.

`TenantState.admit` is the whole decision; the quota stores keep the state (memory here, Redis
in quota_store.py, which runs the same rules as a Lua script).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from controlplane.schema import Tier
from tokenserve.runtime.errors import AlreadyExists, InvalidArgument, ResourceExhausted

SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True)
class Limits:
    """The limits admission enforces for one tenant (its tier with overrides applied)."""

    tier: str
    requests_per_second: float
    tokens_per_minute: int
    daily_tokens: int
    max_concurrency: int

    @classmethod
    def of(cls, tier: Tier) -> "Limits":
        return cls(tier.name, tier.requests_per_second, tier.tokens_per_minute,
                   tier.daily_tokens, tier.max_concurrency)

    @property
    def request_burst(self) -> float:
        return max(1.0, self.requests_per_second)

    def share(self, parts: int) -> "Limits":
        """This tenant's share on one of `parts` gateways (fail-open fallback)."""
        if parts <= 1:
            return self
        return Limits(self.tier, self.requests_per_second / parts,
                      max(1, self.tokens_per_minute // parts), max(1, self.daily_tokens // parts),
                      max(1, self.max_concurrency // parts))


@dataclass(frozen=True)
class Quota:
    """What is left after an admission; goes back to the caller as response metadata."""

    limits: Limits
    remaining_requests: int
    remaining_tokens: int
    remaining_daily_tokens: int

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-ratelimit-limit-requests", f"{self.limits.requests_per_second:g}"),
                ("x-ratelimit-remaining-requests", str(self.remaining_requests)),
                ("x-ratelimit-limit-tokens", str(self.limits.tokens_per_minute)),
                ("x-ratelimit-remaining-tokens", str(self.remaining_tokens)),
                ("x-ratelimit-remaining-daily-tokens", str(self.remaining_daily_tokens)))


@dataclass(frozen=True)
class Reservation:
    """What an admitted request holds until it is settled."""

    tenant_id: str
    request_id: str
    tokens: int
    limits: Limits


def check_fits(limits: Limits, cost: int, max_tokens: int) -> None:
    """InvalidArgument for a request no amount of waiting would admit."""
    for budget, what in ((limits.tokens_per_minute, "tokens/minute"),
                         (limits.daily_tokens, "tokens/day")):
        if cost > budget:
            raise InvalidArgument(
                f"prompt + max_tokens is {cost} tokens (max_tokens {max_tokens}), which can never"
                f" fit the {limits.tier} tier's {budget} {what}; lower max_tokens")


def refused(limit: str, limits: Limits, retry_after: float | None, remaining: int) -> ResourceExhausted:
    """The error for a refusal by `limit` ("rps", "tpm", "daily" or "concurrency")."""
    what = {"rps": f"{limits.requests_per_second:g} requests/second",
            "tpm": f"{limits.tokens_per_minute} tokens/minute",
            "daily": f"{limits.daily_tokens} tokens/day",
            "concurrency": f"{limits.max_concurrency} concurrent requests"}[limit]
    when = (f"; retry in {retry_after:.3g} s" if retry_after is not None
            else "; retry when one of your requests finishes")
    return ResourceExhausted(f"{limit} limit: the {limits.tier} tier allows {what}{when}",
                             retry_after=retry_after, limit=limit, remaining=remaining)


def already_in_flight(request_id: str) -> AlreadyExists:
    return AlreadyExists(f"request_id {request_id!r} is already in flight; use a new id for a"
                         " new request")


@dataclass
class Bucket:
    """A token bucket: `level` units available at time `at`, refilling at `rate`/s up to
    `capacity`. A new bucket is full."""

    level: float = math.inf
    at: float = 0.0

    def refill(self, capacity: float, rate: float, now: float) -> float:
        # A lowered capacity (tier change) clamps the level at once.
        self.level = min(capacity, self.level + max(0.0, now - self.at) * rate)
        self.at = now
        return self.level

    def give_back(self, amount: float, capacity: float) -> None:
        self.level = min(capacity, self.level + amount)


def _wait(missing: float, rate: float) -> float:
    return missing / rate if rate > 0 else math.inf


@dataclass
class TenantState:
    requests: Bucket = field(default_factory=Bucket)
    minute: Bucket = field(default_factory=Bucket)
    day: Bucket = field(default_factory=Bucket)
    # request id -> expiry (monotonic seconds): requests admitted and not yet settled.
    in_flight: dict[str, float] = field(default_factory=dict)

    def admit(self, limits: Limits, request_id: str, cost: int, now: float,
              expires_at: float) -> Quota:
        """Takes one request and `cost` tokens, or raises without taking anything."""
        self.in_flight = {r: t for r, t in self.in_flight.items() if t > now}
        if request_id in self.in_flight:
            raise already_in_flight(request_id)
        if len(self.in_flight) >= limits.max_concurrency:
            raise refused("concurrency", limits, None, 0)
        req = self.requests.refill(limits.request_burst, limits.requests_per_second, now)
        if req < 1:
            raise refused("rps", limits, _wait(1 - req, limits.requests_per_second), 0)
        tpm_rate = limits.tokens_per_minute / 60.0
        minute = self.minute.refill(limits.tokens_per_minute, tpm_rate, now)
        if minute < cost:
            raise refused("tpm", limits, _wait(cost - minute, tpm_rate), int(minute))
        day_rate = limits.daily_tokens / SECONDS_PER_DAY
        day = self.day.refill(limits.daily_tokens, day_rate, now)
        if day < cost:
            raise refused("daily", limits, _wait(cost - day, day_rate), int(day))
        self.requests.level -= 1
        self.minute.level -= cost
        self.day.level -= cost
        self.in_flight[request_id] = expires_at
        return Quota(limits, int(self.requests.level), int(self.minute.level),
                     int(self.day.level))

    def settle(self, reservation: Reservation, used: int) -> None:
        """Ends the request: frees its concurrency slot and returns the unused tokens."""
        self.in_flight.pop(reservation.request_id, None)
        unused = max(0, reservation.tokens - used)
        if unused:
            lim = reservation.limits
            self.minute.give_back(unused, lim.tokens_per_minute)
            self.day.give_back(unused, lim.daily_tokens)
