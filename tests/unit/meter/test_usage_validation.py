"""Bad events and queries are refused with a message naming the field."""
from __future__ import annotations

import pytest

from services.meter.usage import (GroupBy, UsageQuery, check_batch_size)
from tests.unit.meter.conftest import event
from tokenserve.runtime.errors import InvalidArgument


@pytest.mark.parametrize("fields, named", [
    ({"event_id": ""}, "events[2].event_id"),
    ({"request_id": ""}, "events[2].request_id"),
    ({"tenant_id": ""}, "events[2].tenant_id"),
    ({"prompt_tokens": -1}, "events[2].prompt_tokens"),
    ({"completion_tokens": -5}, "events[2].completion_tokens"),
    ({"prompt_tokens": 2, "cached_tokens": 3}, "events[2].cached_tokens"),
    ({"finished_at": float("nan")}, "events[2].finished_at"),
    ({"started_at": 10, "finished_at": 5}, "events[2].finished_at"),
    ({"energy_joules": -1.0}, "events[2].energy_joules"),
    ({"model": "x" * 300}, "events[2].model"),
])
def test_bad_event_fields_are_named(fields, named):
    event_id = fields.pop("event_id", "e")
    with pytest.raises(InvalidArgument, match=named.replace("[", r"\[").replace("]", r"\]")):
        event(event_id, where="events[2]", **fields)


def test_batches_over_ten_thousand_events_are_refused():
    check_batch_size(10_000)
    with pytest.raises(InvalidArgument, match="at most 10000"):
        check_batch_size(10_001)


@pytest.mark.parametrize("kw, message", [
    ({"start": 20.0, "end": 10.0}, "end"),
    ({"start": -1.0}, "start"),
    ({"bucket_seconds": 0}, "bucket_seconds"),
    ({"group_by": (GroupBy.APP, GroupBy.APP)}, "twice"),
])
def test_bad_queries_are_refused(kw, message):
    with pytest.raises(InvalidArgument, match=message):
        UsageQuery(**kw)
