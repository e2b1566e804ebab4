"""This gateway's own view of each model version over a sliding window: error rate, time to
first token and the latency the gateway path adds.

The pipeline records every engine attempt when it ends. An attempt a version refused and
another version then served counts as an error of the refusing version: a canary that
refuses half its calls is broken even when retries hide that from the callers. Pure: plain
data and an injected clock.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

# Engine statuses that are the version's fault. Not counted at all: the caller's own
# mistakes (INVALID_ARGUMENT, FAILED_PRECONDITION), a full engine (RESOURCE_EXHAUSTED: load,
# retried elsewhere) and callers that went away (CANCELLED).
SERVER_FAULTS = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED",
                           "DATA_LOSS"})


def counts_as_error(code: str) -> bool | None:
    """True: an error of the version; False: a success; None: not the version's business."""
    if code == "OK":
        return False
    return True if code in SERVER_FAULTS else None


@dataclass(frozen=True)
class _Sample:
    at: float
    ok: bool
    ttft_s: float | None
    added_s: float | None


@dataclass(frozen=True)
class VersionView:
    model: str
    version: str
    window_seconds: float
    requests: int
    errors: int
    # None: no successful request in the window.
    ttft_p99_s: float | None
    added_latency_p50_s: float | None
    added_latency_p99_s: float | None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..1); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class VersionStats:
    """Samples per (model, version), kept for `retain_seconds` and at most `max_samples`."""

    def __init__(self, retain_seconds: float = 600.0, max_samples: int = 20_000,
                 clock: Callable[[], float] = time.monotonic):
        self._retain = retain_seconds
        self._max = max_samples
        self._clock = clock
        self._samples: dict[tuple[str, str], deque[_Sample]] = {}

    def record(self, model: str, version: str, *, ok: bool, ttft_s: float | None = None,
               added_s: float | None = None) -> None:
        now = self._clock()
        q = self._samples.get((model, version))
        if q is None:
            q = self._samples[(model, version)] = deque(maxlen=self._max)
        q.append(_Sample(now, ok, ttft_s if ok else None, added_s if ok else None))
        self._trim(q, now)

    def _trim(self, q: deque[_Sample], now: float) -> None:
        while q and q[0].at < now - self._retain:
            q.popleft()

    def view(self, model: str, version: str, window_seconds: float = 60.0) -> VersionView:
        now = self._clock()
        q = self._samples.get((model, version), ())
        recent = [s for s in q if s.at >= now - window_seconds]
        ttfts = [s.ttft_s for s in recent if s.ttft_s is not None]
        added = [s.added_s for s in recent if s.added_s is not None]
        return VersionView(model, version, window_seconds, len(recent),
                           sum(1 for s in recent if not s.ok), percentile(ttfts, 0.99),
                           percentile(added, 0.5), percentile(added, 0.99))

    def versions(self) -> list[tuple[str, str]]:
        now = self._clock()
        for q in self._samples.values():
            self._trim(q, now)
        return sorted(k for k, q in self._samples.items() if q)
