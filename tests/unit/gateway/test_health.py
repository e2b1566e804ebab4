"""Replica ejection and re-probing, on a fake clock."""
from __future__ import annotations

import pytest

from services.gateway.health import EjectionPolicy, Failure, ReplicaHealth
from tests.unit.gateway.fake_clock import FakeClock


def health(**kw):
    clock = FakeClock()
    return ReplicaHealth(EjectionPolicy(**kw), clock=clock), clock


def test_consecutive_unavailable_calls_eject_and_a_success_resets_the_count():
    h, _ = health(failures=3)
    assert not h.on_failure("a", Failure.UNAVAILABLE)
    assert not h.on_failure("a", Failure.UNAVAILABLE)
    h.on_success("a")
    assert not h.on_failure("a", Failure.UNAVAILABLE)
    assert not h.on_failure("a", Failure.UNAVAILABLE)
    assert h.routable("a")
    assert h.on_failure("a", Failure.UNAVAILABLE)
    assert not h.routable("a") and h.routable("b")
    (out,) = h.ejected()
    assert (out.endpoint, out.ejections, out.reason) == ("a", 1, "3 unavailable calls in a row")


def test_a_deadline_storm_ejects_after_its_own_threshold():
    h, _ = health(failures=2, deadlines=4)
    for _ in range(3):
        assert not h.on_failure("a", Failure.DEADLINE)
    assert h.on_failure("a", Failure.DEADLINE)
    assert h.ejected()[0].reason == "4 deadline calls in a row"


def test_backoff_doubles_per_ejection_in_a_row_and_is_capped():
    p = EjectionPolicy(backoff_seconds=1.0, max_backoff_seconds=5.0)
    assert [p.backoff(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert p.backoff(200) == 5.0
    with pytest.raises(ValueError):
        EjectionPolicy(backoff_seconds=10, max_backoff_seconds=5)


def test_a_probe_is_due_when_the_backoff_ends_and_is_handed_out_once():
    h, clock = health(failures=1, backoff_seconds=2.0)
    h.on_failure("a", Failure.UNAVAILABLE)
    assert h.due_probes() == [] and h.next_probe_in() == 2.0
    clock.advance(1.5)
    assert h.due_probes() == [] and h.next_probe_in() == 0.5
    clock.advance(0.5)
    assert h.due_probes() == ["a"]
    assert h.due_probes() == [] and h.next_probe_in() is None  # being probed
    assert not h.routable("a")  # a backoff that ended is not a readmission


def test_not_serving_probes_keep_it_out_for_longer_and_serving_readmits_it():
    h, clock = health(failures=1, backoff_seconds=1.0, max_backoff_seconds=30.0)
    h.on_failure("a", Failure.UNAVAILABLE)
    clock.advance(1.0)
    assert h.due_probes() == ["a"]
    h.on_probe("a", serving=False)
    assert not h.routable("a") and h.next_probe_in() == 2.0
    assert h.ejected()[0].reason == "health check: not serving"
    clock.advance(2.0)
    assert h.due_probes() == ["a"]
    h.on_probe("a", serving=True)
    assert h.routable("a") and h.ejected() == []


def test_on_probation_one_failure_ejects_again_for_twice_as_long():
    h, clock = health(failures=3, backoff_seconds=1.0)
    for _ in range(3):
        h.on_failure("a", Failure.UNAVAILABLE)
    clock.advance(1.0)
    h.due_probes()
    h.on_probe("a", serving=True)
    assert h.on_failure("a", Failure.UNAVAILABLE)
    assert h.next_probe_in() == 2.0
    clock.advance(2.0)
    h.due_probes()
    h.on_probe("a", serving=True)
    h.on_success("a")  # a call succeeded: the replica is healthy again, history forgotten
    assert not h.on_failure("a", Failure.UNAVAILABLE)


def test_calls_in_flight_when_it_went_out_do_not_extend_the_ejection():
    h, _ = health(failures=1)
    h.on_failure("a", Failure.UNAVAILABLE)
    assert not h.on_failure("a", Failure.UNAVAILABLE)
    h.on_success("a")  # a stream that started before the ejection finished fine
    assert not h.routable("a") and h.ejected()[0].ejections == 1
