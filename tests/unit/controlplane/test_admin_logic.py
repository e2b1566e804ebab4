"""Pure pieces of tsctl: canary weights and argument parsing."""
from __future__ import annotations

import pytest

from controlplane.admin import canary_weights
from controlplane.tsctl_args import parse_assignments, parse_ladder
from tokenserve.runtime.errors import FailedPrecondition, InvalidArgument


@pytest.mark.parametrize("current,version,percent,expected", [
    ({"a": 100}, "b", 10, {"a": 90, "b": 10}),
    ({"a": 90, "b": 10}, "b", 50, {"a": 50, "b": 50}),
    ({"a": 1, "b": 1, "c": 1}, "c", 0, {"a": 50, "b": 50, "c": 0}),
    ({"a": 2, "b": 1}, "c", 1, {"a": 66, "b": 33, "c": 1}),
    ({"a": 100}, "a", 100, {"a": 100}),
])
def test_canary_weights(current, version, percent, expected):
    got = canary_weights(current, version, percent)
    assert got == expected and sum(got.values()) == 100


def test_canary_bad_input():
    with pytest.raises(InvalidArgument, match="0-100"):
        canary_weights({"a": 1}, "b", 101)
    with pytest.raises(FailedPrecondition, match="no other version carries traffic"):
        canary_weights({"b": 5}, "b", 50)


def test_parse_assignments():
    assert parse_assignments(["a=1", "b=2.5"], number=True) == {"a": 1, "b": 2.5}
    with pytest.raises(InvalidArgument, match="expected NAME=VALUE"):
        parse_assignments(["a"])
    with pytest.raises(InvalidArgument, match="b: expected an integer"):
        parse_assignments(["b=2.5"], number=True, integer=True)
    assert parse_ladder(["free=queue, reject"]) == {"free": ("queue", "reject")}
