"""Bad events and queries are refused with a message naming the event index and the field."""
from __future__ import annotations

import re

import pytest

from services.meter.usage import GroupBy, IngestRules, UsageQuery
from tests.unit.meter.conftest import event
from tokenserve.runtime.errors import InvalidArgument

NOW = 1_800_000_000.0
RULES = IngestRules(clock=lambda: NOW, known_tenants=lambda: {"t1", "t2"})


def good(event_id: str, **kw):
    kw.setdefault("finished_at", NOW - 60)
    return event(event_id, **kw)


@pytest.mark.parametrize("fields, named", [
    ({"event_id": ""}, "events[2].event_id"),
    ({"request_id": ""}, "events[2].request_id"),
    ({"tenant_id": ""}, "events[2].tenant_id"),
    ({"tenant_id": "nobody"}, "events[2].tenant_id 'nobody' is not a configured tenant"),
    ({"prompt_tokens": -1}, "events[2].prompt_tokens"),
    ({"completion_tokens": -5}, "events[2].completion_tokens"),
    ({"prompt_tokens": 2, "cached_tokens": 3}, "events[2].cached_tokens"),
    ({"finished_at": float("nan")}, "events[2].finished_at"),
    ({"finished_at": NOW - 36 * 86400}, "events[2].finished_at .* outside the accepted window"),
    ({"finished_at": NOW + 301}, "events[2].finished_at .* outside the accepted window"),
    ({"started_at": NOW - 10, "finished_at": NOW - 20}, "events[2].finished_at must be >="),
    ({"energy_joules": -1.0}, "events[2].energy_joules"),
    ({"model": "x" * 300}, "events[2].model is 300 characters"),
    ({"app": "bot\x00"}, "events[2].app contains a NUL byte"),
    ({"status": "O\x00K"}, "events[2].status contains a NUL byte"),
])
def test_bad_event_fields_are_named_with_the_index(fields, named):
    event_id = fields.pop("event_id", "e")
    batch = [good("a"), good("b"), good(event_id, **fields)]
    with pytest.raises(InvalidArgument, match=re.escape(named).replace(r"\.\*", ".*")):
        RULES.check_batch(batch)


def test_a_good_batch_passes_and_the_window_is_configurable():
    RULES.check_batch([good("a"), good("b", tenant_id="t2", finished_at=NOW + 299)])
    narrow = IngestRules(clock=lambda: NOW, max_age_seconds=30)
    with pytest.raises(InvalidArgument, match="outside the accepted window"):
        narrow.check_batch([good("a")])


def test_without_a_control_plane_tenants_are_not_checked():
    IngestRules(clock=lambda: NOW).check_batch([good("a", tenant_id="anyone")])


def test_batches_over_ten_thousand_events_are_refused():
    with pytest.raises(InvalidArgument, match="at most 10000"):
        RULES.check_batch([good(str(i)) for i in range(10_001)])


@pytest.mark.parametrize("kw, message", [
    ({"start": 20.0, "end": 10.0}, "end"),
    ({"start": -1.0}, "start"),
    ({"bucket_seconds": 0}, "bucket_seconds"),
    ({"group_by": (GroupBy.APP, GroupBy.APP)}, "twice"),
])
def test_bad_queries_are_refused(kw, message):
    with pytest.raises(InvalidArgument, match=message):
        UsageQuery(**kw)
