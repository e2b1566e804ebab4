"""tsctl usage's window and grouping arguments (pure parsing)."""
from __future__ import annotations

import argparse

import pytest

from controlplane.tsctl_usage import parse_duration, parse_time, query, window
from tokenserve.meter.v1 import meter_pb2
from tokenserve.runtime.errors import InvalidArgument


def args(**kw):
    base = dict(since=None, start=None, end=None, tenant=None, group_by="", bucket=3600,
                source="gateway")
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("30m", 1800), ("1h", 3600),
                                           ("1.5h", 5400), ("35d", 35 * 86400)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["1", "h", "1w", "-1h", "yesterday"])
def test_bad_durations_say_what_to_write(text):
    with pytest.raises(InvalidArgument, match="e.g. 1h"):
        parse_duration(text)


def test_times_are_unix_seconds_or_iso_dates_in_utc():
    assert parse_time("1700000000") == 1_700_000_000
    assert parse_time("2026-12-01") == 1_796_083_200
    assert parse_time("2026-12-01T01:00:00+01:00") == 1_796_083_200


def test_window_and_query():
    assert window(args(since="1h"), now=10_000) == (6400, 0)
    assert window(args(start="100", end="200")) == (100, 200)
    with pytest.raises(InvalidArgument, match="not both"):
        window(args(since="1h", start="100"))
    q = query(args(tenant="acme", group_by="tenant, version,tier", source="engine"))
    assert (q.tenant_id, list(q.group_by), q.source) == (
        "acme", [meter_pb2.GROUP_BY_TENANT, meter_pb2.GROUP_BY_VERSION, meter_pb2.GROUP_BY_TIER],
        meter_pb2.SOURCE_ENGINE)
    with pytest.raises(InvalidArgument, match="unknown colour"):
        query(args(group_by="colour"))
