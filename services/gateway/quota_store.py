"""Where admission keeps its counters: this process (one gateway) or Redis (several).

Both stores apply the rules of `admission.TenantState`; the Redis store runs them as one Lua
script per call, so N gateways reserving for the same tenant at once are serialised by Redis
and together never overspend it. Redis's own clock is the time base there, so gateways'
clocks need not agree. A reservation whose gateway died before settling frees its
concurrency slot when it expires (its deadline plus a minute); its tokens stay spent.

When Redis cannot be reached the store follows `fail`: "closed" refuses with UNAVAILABLE,
"open" admits against this gateway's share of each limit (limit / live gateways) in a local
store. Either way the failure is counted; nothing is ever admitted unlimited.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import structlog

from services.gateway import metrics
from services.gateway.admission import (Limits, Quota, Reservation, TenantState,
                                        already_in_flight, refused)
from tokenserve.runtime.errors import Unavailable

# Lazy: resolved at first use, after configure_logging (JSON lines).
log = structlog.get_logger(component="quota_store")

# A reservation outlives its request's deadline by this much before it expires unsettled.
EXPIRY_GRACE_SECONDS = 60.0
_STATE_TTL_SECONDS = 2 * 86_400


class QuotaStore(Protocol):
    async def admit(self, tenant_id: str, limits: Limits, request_id: str, cost: int,
                    timeout: float) -> tuple[Reservation, Quota]:
        """Reserves one request and `cost` tokens, or raises (ResourceExhausted,
        AlreadyExists, Unavailable) having reserved nothing."""

    async def settle(self, reservation: Reservation, used: int) -> None:
        """Ends the request and gives back the tokens it did not use. Never raises."""

    async def close(self) -> None: ...


@dataclass(frozen=True)
class LocalReservation(Reservation):
    """A reservation held by a MemoryQuotaStore (also the Redis store's fail-open fallback)."""


class MemoryQuotaStore:
    """Counters in this process: exact for one gateway."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._tenants: dict[str, TenantState] = {}

    async def admit(self, tenant_id, limits, request_id, cost, timeout):
        return self.admit_now(tenant_id, limits, request_id, cost, timeout)

    def admit_now(self, tenant_id: str, limits: Limits, request_id: str, cost: int,
                  timeout: float) -> tuple[Reservation, Quota]:
        now = self._clock()
        state = self._tenants.setdefault(tenant_id, TenantState())
        quota = state.admit(limits, request_id, cost, now, now + timeout + EXPIRY_GRACE_SECONDS)
        return LocalReservation(tenant_id, request_id, cost, limits), quota

    async def settle(self, reservation, used):
        self.settle_now(reservation, used)

    def settle_now(self, reservation: Reservation, used: int) -> None:
        state = self._tenants.get(reservation.tenant_id)
        if state is not None:
            state.settle(reservation, used)

    async def close(self) -> None:
        pass


class NoQuotaStore:
    """`--quota-store off`: every request is admitted (benchmarks, or a gateway behind another
    limiter). The gateway logs a warning at start when it runs this way."""

    async def admit(self, tenant_id, limits, request_id, cost, timeout):
        return Reservation(tenant_id, request_id, cost, limits), None

    async def settle(self, reservation, used):
        pass

    async def close(self) -> None:
        pass


# The rules of TenantState.admit, in Lua. KEYS: state hash, in-flight sorted set.
# ARGV: rps, tokens/minute, tokens/day, max concurrency, request id, cost, expiry seconds,
# state ttl. Returns {"ok", requests left, tokens left, daily tokens left},
# {"refused", limit, retry seconds or "", remaining} or {"exists"}.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rps, tpm, daily, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local rid, cost, expiry, ttl = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZSCORE', KEYS[2], rid) then return {'exists'} end
if redis.call('ZCARD', KEYS[2]) >= conc then return {'refused', 'concurrency', '', '0'} end
local v = redis.call('HMGET', KEYS[1], 'r', 'rt', 'm', 'mt', 'd', 'dt')
local function refill(level, at, cap, rate)
  if not level then return cap end
  local dt = now - tonumber(at)
  if dt < 0 then dt = 0 end
  return math.min(cap, tonumber(level) + dt * rate)
end
local r = refill(v[1], v[2], math.max(1, rps), rps)
if r < 1 then return {'refused', 'rps', tostring((1 - r) / rps), '0'} end
local mrate = tpm / 60
local m = refill(v[3], v[4], tpm, mrate)
if m < cost then return {'refused', 'tpm', tostring((cost - m) / mrate), tostring(math.floor(m))} end
local drate = daily / 86400
local d = refill(v[5], v[6], daily, drate)
if d < cost then return {'refused', 'daily', tostring((cost - d) / drate), tostring(math.floor(d))} end
r, m, d = r - 1, m - cost, d - cost
local ts = tostring(now)
redis.call('HSET', KEYS[1], 'r', tostring(r), 'rt', ts, 'm', tostring(m), 'mt', ts, 'd', tostring(d), 'dt', ts)
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('ZADD', KEYS[2], now + expiry, rid)
redis.call('EXPIRE', KEYS[2], ttl)
return {'ok', tostring(math.floor(r)), tostring(math.floor(m)), tostring(math.floor(d))}
"""

# TenantState.settle. KEYS as above; ARGV: request id, unused tokens, tokens/minute, tokens/day.
_SETTLE = """
redis.call('ZREM', KEYS[2], ARGV[1])
local unused = tonumber(ARGV[2])
if unused > 0 then
  local v = redis.call('HMGET', KEYS[1], 'm', 'd')
  if v[1] then
    redis.call('HSET', KEYS[1], 'm', tostring(math.min(tonumber(ARGV[3]), tonumber(v[1]) + unused)),
                                'd', tostring(math.min(tonumber(ARGV[4]), tonumber(v[2]) + unused)))
  end
end
return 1
"""


@dataclass
class _Breaker:
    """After a failure, skip Redis for `pause` seconds (each call would wait for a timeout)."""

    pause: float = 1.0
    open_until: float = field(default=0.0)

    def allows(self) -> bool:
        return time.monotonic() >= self.open_until

    def trip(self) -> None:
        self.open_until = time.monotonic() + self.pause


class RedisQuotaStore:
    """Counters in Redis, shared by every gateway that points at it."""

    def __init__(self, url: str, *, fail: str = "closed", live_gateways: Callable[[], int] = lambda: 1,
                 timeout: float = 0.5, prefix: str = "tokenserve:quota",
                 expiry_grace: float = EXPIRY_GRACE_SECONDS):
        import redis.asyncio as redis_asyncio  # only gateways configured for Redis need it

        self._redis = redis_asyncio.Redis.from_url(url, socket_timeout=timeout,
                                                   socket_connect_timeout=timeout)
        self._admit = self._redis.register_script(_ADMIT)
        self._settle = self._redis.register_script(_SETTLE)
        self._fail = fail
        self._live_gateways = live_gateways
        self._prefix = prefix
        self._expiry_grace = expiry_grace
        self._fallback = MemoryQuotaStore()
        self._breaker = _Breaker()

    def _keys(self, tenant_id: str) -> list[str]:
        # {tenant} hash tag: both keys of a tenant live on one Redis Cluster slot.
        base = f"{self._prefix}:{{{tenant_id}}}"
        return [base, f"{base}:inflight"]

    async def admit(self, tenant_id, limits, request_id, cost, timeout):
        if self._breaker.allows():
            try:
                answer = await self._admit(
                    keys=self._keys(tenant_id),
                    args=[repr(limits.requests_per_second), limits.tokens_per_minute,
                          limits.daily_tokens, limits.max_concurrency, request_id, cost,
                          timeout + self._expiry_grace, _STATE_TTL_SECONDS])
            except Exception as e:  # noqa: BLE001 - redis-py raises several unrelated types
                if not _is_redis_down(e):
                    raise
                self._unreachable(e)
            else:
                return _answer(answer, tenant_id, limits, request_id, cost)
        if self._fail != "open":
            raise Unavailable("the quota store (Redis) is unreachable and this gateway is set"
                              " to fail closed; retry shortly")
        parts = max(1, self._live_gateways())
        admitted = self._fallback.admit_now(tenant_id, limits.share(parts), request_id, cost,
                                            timeout)
        metrics.QUOTA_FALLBACK_ADMISSIONS.inc()
        return admitted

    async def settle(self, reservation, used):
        if isinstance(reservation, LocalReservation):
            self._fallback.settle_now(reservation, used)
            return
        lim = reservation.limits
        try:
            await self._settle(keys=self._keys(reservation.tenant_id),
                               args=[reservation.request_id, max(0, reservation.tokens - used),
                                     lim.tokens_per_minute, lim.daily_tokens])
        except Exception as e:  # noqa: BLE001
            if not _is_redis_down(e):
                raise
            # The refund is lost (the tenant is charged the whole reservation) and the slot
            # frees when the reservation expires: never more than the budget.
            self._unreachable(e)
            metrics.QUOTA_SETTLE_FAILURES.inc()

    def _unreachable(self, e: Exception) -> None:
        self._breaker.trip()
        metrics.QUOTA_STORE_ERRORS.labels(self._fail).inc()
        log.warning("quota_store_unreachable", error_type=type(e).__name__, fail=self._fail)

    async def close(self) -> None:
        await self._redis.aclose()


def _is_redis_down(e: Exception) -> bool:
    from redis.exceptions import ConnectionError, TimeoutError

    return isinstance(e, (ConnectionError, TimeoutError, OSError, asyncio.TimeoutError))


def _answer(answer: list, tenant_id: str, limits: Limits, request_id: str,
            cost: int) -> tuple[Reservation, Quota]:
    status, *rest = [a.decode() if isinstance(a, bytes) else str(a) for a in answer]
    if status == "exists":
        raise already_in_flight(request_id)
    if status == "refused":
        limit, retry, remaining = rest
        raise refused(limit, limits, float(retry) if retry else None, int(float(remaining)))
    requests, tokens, day = (int(float(x)) for x in rest)
    return (Reservation(tenant_id, request_id, cost, limits),
            Quota(limits, requests, tokens, day))
