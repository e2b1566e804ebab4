"""When a crashed process is restarted, and when to stop trying: the launcher's policy, pure.

    crashes = CrashHistory(RestartPolicy())
    decision = crashes.crashed("meter")   # Restart(attempt=1, delay=0.5) or GiveUp(...)

Backoff grows with the crashes of that process inside the window (0.5 s, 1 s, 2 s, ...,
capped); a process that stays up longer than the window starts again from the first delay.
After `max_crashes` crashes inside the window the answer is GiveUp: the process cannot stay
up, and restarting it forever would hide that.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class RestartPolicy:
    initial_delay: float = 0.5
    factor: float = 2.0
    max_delay: float = 30.0
    # GiveUp at the max_crashes-th crash of one process within window seconds.
    max_crashes: int = 5
    window: float = 60.0

    def __post_init__(self):
        if self.initial_delay < 0 or self.max_delay < self.initial_delay:
            raise ValueError("need 0 <= initial_delay <= max_delay")
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1, got {self.factor}")
        if self.max_crashes < 1 or self.window <= 0:
            raise ValueError("need max_crashes >= 1 and window > 0")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before restart number `attempt` (1-based) within the window."""
        return min(self.max_delay, self.initial_delay * self.factor ** (attempt - 1))


@dataclass(frozen=True)
class Restart:
    attempt: int  # crashes of this process within the window, this one included
    delay: float  # seconds to wait before starting it again


@dataclass(frozen=True)
class GiveUp:
    crashes: int
    window: float


class CrashHistory:
    """Crash times per process; `crashed` says what to do about the latest one."""

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self._clock = clock
        self._recent: dict[str, deque[float]] = {}
        # Restarts decided per process over the whole run (what `tokenserve up` reports).
        self.restarts: dict[str, int] = {}

    def crashed(self, name: str) -> Restart | GiveUp:
        now = self._clock()
        recent = self._recent.setdefault(name, deque())
        recent.append(now)
        while recent and recent[0] <= now - self.policy.window:
            recent.popleft()
        if len(recent) >= self.policy.max_crashes:
            return GiveUp(len(recent), self.policy.window)
        self.restarts[name] = self.restarts.get(name, 0) + 1
        return Restart(len(recent), self.policy.delay(len(recent)))
