"""The usage record: what one request used, as one source (the gateway or an engine) saw it.

This dataclass is the one definition of the usage fields. Every conversion is derived from
its fields, never typed out again: the spools' JSON (`to_json` / `from_json`), the meter's
protobuf `UsageEvent` (`to_pb` / `from_pb`, a test checks the message has exactly these
fields) and the meter's SQL row (`to_row` / `from_row`, in `FIELDS` order). Adding a field is
this class, `UsageEvent` in meter.proto and a ledger migration; tests fail until all three
agree. Never holds prompt or completion text.
"""
from __future__ import annotations

import enum
import json
import typing
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence

from tokenserve.common.v1 import common_pb2
from tokenserve.meter.v1 import meter_pb2


class Source(str, enum.Enum):
    GATEWAY = "gateway"
    ENGINE = "engine"


@dataclass(frozen=True)
class UsageRecord:
    # Unique id of this record (the meter's dedupe key).
    event_id: str
    # The request it belongs to (the reconciliation join key).
    request_id: str
    source: Source
    tenant_id: str
    # Application label chosen by the tenant (gateway only).
    app: str = ""
    model: str = ""
    model_version: str = ""
    # The tenant's tier when the request ran (gateway only).
    tier: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # gRPC status code name the request ended with: "OK", "CANCELLED", ...
    status: str = "OK"
    # "stop", "length", "cancelled", "error"; "" when this source never saw an end.
    finish_reason: str = ""
    # The engine recomputed the request's KV at least once (engine only).
    preempted: bool = False
    # Cancelled by the client or its deadline before it finished.
    cancelled: bool = False
    # Unix seconds.
    started_at: float = 0.0
    finished_at: float = 0.0
    energy_joules: float = 0.0
    # energy_joules comes from a configured watts figure, not a counter.
    energy_estimated: bool = False


# Field names in declaration order: the SQL column order and the CSV header.
FIELDS: tuple[str, ...] = tuple(f.name for f in fields(UsageRecord))
# Field name -> its Python type (Source, str, int, float or bool).
TYPES: Mapping[str, type] = {n: t for n, t in typing.get_type_hints(UsageRecord).items()
                             if n in FIELDS}
TEXT_FIELDS = tuple(n for n in FIELDS if TYPES[n] is str)
COUNT_FIELDS = tuple(n for n in FIELDS if TYPES[n] is int)


def finish_reason_name(value: int) -> str:
    """common.v1.FinishReason -> "stop", "length", ...; "" for UNSPECIFIED."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return ""
    return common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def _coerce(name: str, value: Any) -> Any:
    kind = TYPES[name]
    return kind(value)


def from_values(values: Mapping[str, Any]) -> UsageRecord:
    """A record from plain values keyed by field name (JSON, SQL); each coerced to its type."""
    return UsageRecord(**{k: _coerce(k, v) for k, v in values.items() if k in TYPES})


def to_json(record: UsageRecord) -> str:
    return json.dumps(asdict(record))


def from_json(text: str) -> UsageRecord:
    values = json.loads(text)
    # Spools written before the engine had its own record hold gateway records without it.
    values.setdefault("source", Source.GATEWAY.value)
    return from_values(values)


def _to_sql(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, bool):
        return int(value)
    return value


def to_row(record: UsageRecord) -> tuple:
    """The SQL row, in FIELDS order (source as its text, flags as 0/1)."""
    return tuple(_to_sql(getattr(record, n)) for n in FIELDS)


def from_row(row: Sequence) -> UsageRecord:
    return from_values(dict(zip(FIELDS, row)))


def source_to_pb(source: Source) -> int:
    return meter_pb2.Source.Value(f"SOURCE_{source.name}")


def source_from_pb(value: int) -> Source | None:
    """None for SOURCE_UNSPECIFIED or a number this build does not know."""
    name = meter_pb2.Source.Name(value) if value in meter_pb2.Source.values() else ""
    return Source.__members__.get(name.removeprefix("SOURCE_"))


def to_pb(record: UsageRecord) -> meter_pb2.UsageEvent:
    values = {n: getattr(record, n) for n in FIELDS}
    values["source"] = source_to_pb(record.source)
    return meter_pb2.UsageEvent(**values)


def from_pb(pb: meter_pb2.UsageEvent) -> UsageRecord:
    """Raises ValueError when the source is not SOURCE_GATEWAY or SOURCE_ENGINE."""
    source = source_from_pb(pb.source)
    if source is None:
        raise ValueError(f"source must be SOURCE_GATEWAY or SOURCE_ENGINE, got {pb.source}")
    values = {n: getattr(pb, n) for n in FIELDS}
    values["source"] = source
    return UsageRecord(**values)
