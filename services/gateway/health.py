"""Which engine replicas are ejected from routing, and when each is probed again.

Pure policy over plain data and an injected clock (no grpc, no asyncio): the pipeline reports
each engine call's outcome, the prober reports grpc.health.v1 checks, the router asks
`routable`.

- Ejected after `failures` consecutive UNAVAILABLE calls (unreachable, still loading,
  draining, or failed while running), or `deadlines` consecutive calls whose deadline passed
  before the first token (a deadline storm: the engine takes requests and answers none).
  One success resets both counts. RESOURCE_EXHAUSTED (full) is load, not failure.
- Out for a backoff of `backoff_seconds * 2**(ejections - 1)`, capped at
  `max_backoff_seconds`. When it ends the replica is due for a probe: SERVING returns it to
  routing on probation: until a call succeeds there, one failure ejects it again, for twice
  as long. NOT_SERVING or no answer ejects it again for the next step.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable


class Failure(enum.Enum):
    UNAVAILABLE = "unavailable"
    DEADLINE = "deadline"


@dataclass(frozen=True)
class EjectionPolicy:
    failures: int = 3
    deadlines: int = 5
    backoff_seconds: float = 1.0
    max_backoff_seconds: float = 30.0

    def __post_init__(self):
        if self.failures < 1 or self.deadlines < 1:
            raise ValueError("ejection thresholds must be >= 1")
        if not 0 < self.backoff_seconds <= self.max_backoff_seconds:
            raise ValueError("need 0 < eject backoff <= eject max backoff, got "
                             f"{self.backoff_seconds} and {self.max_backoff_seconds}")

    def backoff(self, ejections: int) -> float:
        """Seconds out for the `ejections`-th ejection in a row (1-based)."""
        return min(self.max_backoff_seconds, self.backoff_seconds * 2 ** min(ejections - 1, 30))


@dataclass
class _Replica:
    failures: int = 0
    deadlines: int = 0
    ejections: int = 0  # in a row, without a successful call since
    out_until: float | None = None  # None: in routing
    probing: bool = False
    reason: str = ""


@dataclass(frozen=True)
class Ejected:
    endpoint: str
    seconds_left: float  # until its next probe (0: due or being probed)
    ejections: int
    reason: str


class ReplicaHealth:
    def __init__(self, policy: EjectionPolicy = EjectionPolicy(),
                 clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self._clock = clock
        self._on_eject: Callable[[str, str], None] | None = None
        # Only replicas with something to remember (a failure, an ejection) have an entry.
        self._replicas: dict[str, _Replica] = {}

    def subscribe(self, on_eject: Callable[[str, str], None]) -> None:
        """`on_eject(endpoint, reason)` is called on each ejection (the prober's wake-up)."""
        self._on_eject = on_eject

    # -- what the router asks ---------------------------------------------------------------
    def routable(self, endpoint: str) -> bool:
        r = self._replicas.get(endpoint)
        return r is None or r.out_until is None

    def ejected(self) -> list[Ejected]:
        now = self._clock()
        return [Ejected(ep, max(0.0, r.out_until - now), r.ejections, r.reason)
                for ep, r in sorted(self._replicas.items()) if r.out_until is not None]

    # -- what the pipeline reports ----------------------------------------------------------
    def on_success(self, endpoint: str) -> None:
        r = self._replicas.get(endpoint)
        if r is not None and r.out_until is None:
            del self._replicas[endpoint]

    def on_failure(self, endpoint: str, kind: Failure) -> bool:
        """Counts a failed call; True when this one ejects the replica."""
        r = self._replicas.setdefault(endpoint, _Replica())
        if r.out_until is not None:
            return False  # calls that were in flight when it went out
        if kind is Failure.UNAVAILABLE:
            r.failures += 1
            tripped = r.failures >= self.policy.failures
        else:
            r.deadlines += 1
            tripped = r.deadlines >= self.policy.deadlines
        tripped = tripped or r.ejections > 0  # on probation
        if tripped:
            count = r.failures if kind is Failure.UNAVAILABLE else r.deadlines
            self._eject(endpoint, r, f"{count} {kind.value} call{'s' * (count > 1)} in a row"
                                     + (" on probation" if r.ejections else ""))
        return tripped

    def _eject(self, endpoint: str, r: _Replica, reason: str) -> None:
        r.ejections += 1
        r.failures = r.deadlines = 0
        r.out_until = self._clock() + self.policy.backoff(r.ejections)
        r.probing = False
        r.reason = reason
        if self._on_eject is not None:
            self._on_eject(endpoint, reason)

    # -- what the prober asks and reports ---------------------------------------------------
    def due_probes(self) -> list[str]:
        """Ejected replicas whose backoff has ended, each handed out once per backoff."""
        now = self._clock()
        due = [ep for ep, r in self._replicas.items()
               if r.out_until is not None and not r.probing and r.out_until <= now]
        for ep in due:
            self._replicas[ep].probing = True
        return sorted(due)

    def next_probe_in(self) -> float | None:
        """Seconds until the next backoff ends (None: nothing is waiting for a probe)."""
        waits = [r.out_until for r in self._replicas.values()
                 if r.out_until is not None and not r.probing]
        return max(0.0, min(waits) - self._clock()) if waits else None

    def on_probe(self, endpoint: str, serving: bool) -> None:
        r = self._replicas.get(endpoint)
        if r is None or r.out_until is None:
            return
        if serving:
            r.out_until, r.probing, r.reason = None, False, ""
        else:
            self._eject(endpoint, r, "health check: not serving")
