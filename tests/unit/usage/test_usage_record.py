"""The usage record is the one definition: the meter's proto message has exactly its fields,
and every conversion (JSON, proto, SQL row) gives back the same record, field for field."""
from __future__ import annotations

import dataclasses

import pytest

from tokenserve.common.v1 import common_pb2
from tokenserve.meter.v1 import meter_pb2
from tokenserve.usage import (FIELDS, Source, UsageRecord, finish_reason_name, from_json,
                              from_pb, from_row, to_json, to_pb, to_row)


def full_record(source: Source = Source.ENGINE) -> UsageRecord:
    """Every field set to a value other than its default."""
    return UsageRecord(
        event_id="ev-1", request_id="req-1", source=source, tenant_id="acme", app="bot",
        model="smollm2", model_version="q4_1", tier="premium", prompt_tokens=12,
        completion_tokens=34, cached_tokens=8, status="CANCELLED", finish_reason="cancelled",
        preempted=True, cancelled=True, started_at=1_700_000_000.25,
        finished_at=1_700_000_003.5, energy_joules=1.125, energy_estimated=True)


def test_the_proto_message_has_exactly_the_record_fields():
    assert set(meter_pb2.UsageEvent.DESCRIPTOR.fields_by_name) == set(FIELDS)


def test_full_record_sets_every_field_off_its_default():
    defaults = UsageRecord(event_id="", request_id="", source=Source.GATEWAY, tenant_id="")
    rec = full_record()
    assert [f.name for f in dataclasses.fields(rec)
            if getattr(rec, f.name) == getattr(defaults, f.name)] == []


@pytest.mark.parametrize("source", list(Source))
def test_every_conversion_round_trips_every_field(source):
    rec = full_record(source)
    assert from_json(to_json(rec)) == rec
    assert from_pb(to_pb(rec)) == rec
    assert from_row(to_row(rec)) == rec
    assert from_pb(meter_pb2.UsageEvent.FromString(to_pb(rec).SerializeToString())) == rec


def test_an_unknown_source_is_refused():
    with pytest.raises(ValueError, match="source must be"):
        from_pb(meter_pb2.UsageEvent(event_id="e", source=meter_pb2.SOURCE_UNSPECIFIED))


def test_finish_reasons_are_named_from_the_proto_enum():
    assert finish_reason_name(common_pb2.FINISH_REASON_STOP) == "stop"
    assert finish_reason_name(common_pb2.FINISH_REASON_CANCELLED) == "cancelled"
    assert finish_reason_name(common_pb2.FINISH_REASON_UNSPECIFIED) == ""
