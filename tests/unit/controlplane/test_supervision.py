"""The launcher's restart policy, on a fake clock."""
from __future__ import annotations

import pytest

from controlplane.supervision import CrashHistory, GiveUp, Restart, RestartPolicy


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def test_backoff_doubles_per_crash_in_the_window_and_is_capped(clock):
    crashes = CrashHistory(RestartPolicy(initial_delay=0.5, max_delay=3, max_crashes=10,
                                         window=60), clock)
    delays = []
    for _ in range(6):
        decision = crashes.crashed("meter")
        delays.append((decision.attempt, decision.delay))
        clock.now += 1
    assert delays == [(1, 0.5), (2, 1.0), (3, 2.0), (4, 3), (5, 3), (6, 3)]
    assert crashes.restarts == {"meter": 6}


def test_gives_up_at_the_fifth_crash_within_sixty_seconds(clock):
    crashes = CrashHistory(RestartPolicy(), clock)
    for _ in range(4):
        assert isinstance(crashes.crashed("engine"), Restart)
        clock.now += 10
    assert crashes.crashed("engine") == GiveUp(crashes=5, window=60.0)
    assert crashes.restarts == {"engine": 4}


def test_crashes_older_than_the_window_are_forgotten(clock):
    crashes = CrashHistory(RestartPolicy(), clock)
    for _ in range(4):
        crashes.crashed("meter")
        clock.now += 20  # 4 crashes over 80 s: never 5 inside one minute
    decision = crashes.crashed("meter")
    assert isinstance(decision, Restart)
    assert decision.attempt == 3  # the crashes at +40 and +60 s are still inside the window
    clock.now += 61
    assert crashes.crashed("meter") == Restart(attempt=1, delay=0.5)  # up a minute: fresh start


def test_each_process_has_its_own_history(clock):
    crashes = CrashHistory(RestartPolicy(max_crashes=2), clock)
    assert crashes.crashed("meter") == Restart(1, 0.5)
    assert crashes.crashed("engine") == Restart(1, 0.5)
    assert isinstance(crashes.crashed("meter"), GiveUp)
    assert crashes.restarts == {"meter": 1, "engine": 1}


@pytest.mark.parametrize("kwargs", [dict(initial_delay=-1), dict(factor=0.5),
                                    dict(max_crashes=0), dict(window=0),
                                    dict(initial_delay=5, max_delay=1)])
def test_policy_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)
