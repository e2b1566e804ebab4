"""The canary guard as each gateway applies it: the guarded canary against its stable version
over the guard's window (this gateway's own view, version_stats), and on a breach a rollback
through the control plane (controlplane.admin.roll_back_canary: one audited transaction on
the route's mod revision, so gateways that see the breach together make one rollback).

Only what happened since this gateway first saw the guard is judged: samples of an earlier,
rolled back canary of the same version must not condemn its next try.
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import structlog

from controlplane.schema import CanaryGuard
from controlplane.snapshot import ConfigSnapshot
from services.gateway import metrics
from services.gateway.version_stats import VersionStats, VersionView

log = structlog.get_logger(component="canary")

# (model, canary version, reason) -> revision of the rollback, or None when another writer
# got there first.
Rollback = Callable[[str, str, str], Awaitable[int | None]]


def breach(guard: CanaryGuard, canary: VersionView, stable: VersionView) -> str | None:
    """Why the canary broke its guard, or None. A limit counts only where the canary is also
    worse than the stable version (a fault both share is not the canary's), unless the stable
    version has too few requests in the window to compare with."""
    if canary.requests < guard.min_requests:
        return None
    comparable = stable.requests >= guard.min_requests
    found = []
    if guard.max_error_rate is not None and canary.error_rate > guard.max_error_rate and (
            not comparable or canary.error_rate > stable.error_rate):
        found.append(f"error rate {canary.error_rate:.2f} > {guard.max_error_rate:g}"
                     f" (stable {guard.stable}: "
                     f"{f'{stable.error_rate:.2f}' if comparable else 'too few requests'})")
    p99 = canary.ttft_p99_s
    if guard.max_ttft_p99_seconds is not None and p99 is not None \
            and p99 > guard.max_ttft_p99_seconds and (
                not comparable or stable.ttft_p99_s is None or p99 > stable.ttft_p99_s):
        theirs = stable.ttft_p99_s
        found.append(f"ttft p99 {p99:.3f}s > {guard.max_ttft_p99_seconds:g}s (stable"
                     f" {guard.stable}: {f'{theirs:.3f}s' if comparable and theirs else 'n/a'})")
    if not found:
        return None
    return (f"canary {guard.version} broke its guard over {canary.window_seconds:.0f}s"
            f" ({canary.requests} requests): {'; '.join(found)}")


class CanaryGuardian:
    """Checks a model's guard at most every `check_interval` seconds (when a request of the
    model ends) and starts the rollback in the background on a breach."""

    def __init__(self, stats: VersionStats, rollback: Rollback, *,
                 check_interval: float = 0.5, retry_after: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        self._stats = stats
        self._rollback = rollback
        self._interval = check_interval
        self._retry_after = retry_after
        self._clock = clock
        # model -> (the guard, when this gateway first saw it)
        self._seen: dict[str, tuple[CanaryGuard, float]] = {}
        self._checked: dict[str, float] = {}
        self._busy_until: dict[str, float] = {}  # a rollback sent, or failed: wait for the watch
        self._tasks: set[asyncio.Task] = set()

    def observe(self, snap: ConfigSnapshot, model: str) -> None:
        route = snap.routes.get(model)
        guard = route.canary if route is not None else None
        now = self._clock()
        if guard is None:
            self._seen.pop(model, None)
            return
        seen = self._seen.get(model)
        if seen is None or seen[0] != guard:
            self._seen[model] = seen = (guard, now)
        if now - self._checked.get(model, -1e18) < self._interval \
                or now < self._busy_until.get(model, -1e18):
            return
        self._checked[model] = now
        window = min(guard.window_seconds, now - seen[1])
        reason = breach(guard, self._stats.view(model, guard.version, window),
                        self._stats.view(model, guard.stable, window))
        if reason is None:
            return
        self._busy_until[model] = now + self._retry_after
        # Whatever comes next (the same guard written again, say) is judged afresh.
        del self._seen[model]
        task = asyncio.get_running_loop().create_task(self._roll_back(model, guard, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _roll_back(self, model: str, guard: CanaryGuard, reason: str) -> None:
        try:
            revision = await self._rollback(model, guard.version, reason)
        except Exception as e:  # etcd unreachable, ...: the next check tries again
            log.warning("canary_rollback_failed", model=model, version=guard.version,
                        reason=reason, error=str(e))
            return
        if revision is None:
            log.info("canary_rollback_not_needed", model=model, version=guard.version,
                     detail="already rolled back or changed by another writer")
            return
        metrics.CANARY_ROLLBACKS.labels(model, guard.version).inc()
        log.warning("canary_rolled_back", model=model, version=guard.version,
                    stable=guard.stable, reason=reason, revision=revision)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
