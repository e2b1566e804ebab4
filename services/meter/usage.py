"""Plain data of the usage ledger: ingest rules, queries, rows, reconciliation results.

The events themselves are `tokenserve.usage.UsageRecord` (one definition for the gateway,
the engines and the meter). No protobuf here: the servicer converts. A batch is checked
whole before anything is stored; messages name the event index, the field and the rule.
"""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

from tokenserve.runtime.errors import InvalidArgument
from tokenserve.usage import COUNT_FIELDS, TEXT_FIELDS, Source, UsageRecord

MAX_BATCH_EVENTS = 10_000
MAX_ID_CHARS = 128
MAX_LABEL_CHARS = 256
DEFAULT_BUCKET_SECONDS = 3600
# Default accepted finish times: 35 days back (a month of spooled backlog), 5 minutes ahead
# (clock skew between hosts).
DEFAULT_MAX_AGE_SECONDS = 35 * 86400
DEFAULT_MAX_AHEAD_SECONDS = 300
_ID_FIELDS = ("event_id", "request_id", "tenant_id")


class GroupBy(str, enum.Enum):
    TENANT = "tenant_id"
    APP = "app"
    MODEL = "model"
    VERSION = "model_version"
    TIER = "tier"
    TIME = "time"


@dataclass(frozen=True)
class IngestRules:
    """What RecordUsage accepts. `known_tenants` returns the tenant ids configured now (from
    etcd), or None when the meter runs without a control plane (no tenant check)."""

    max_age_seconds: float = DEFAULT_MAX_AGE_SECONDS
    max_ahead_seconds: float = DEFAULT_MAX_AHEAD_SECONDS
    known_tenants: Callable[[], Collection[str] | None] = lambda: None
    clock: Callable[[], float] = time.time

    def check_batch(self, events: Sequence[UsageRecord]) -> None:
        """Raises InvalidArgument for the first bad event; the caller stores nothing then."""
        if len(events) > MAX_BATCH_EVENTS:
            raise InvalidArgument(f"events holds {len(events)} events; at most"
                                  f" {MAX_BATCH_EVENTS} per RecordUsage call")
        now, tenants = self.clock(), self.known_tenants()
        for i, e in enumerate(events):
            self.check_event(e, f"events[{i}]", now, tenants)

    def check_event(self, e: UsageRecord, where: str, now: float,
                    tenants: Collection[str] | None) -> None:
        for name in TEXT_FIELDS:
            value = getattr(e, name)
            limit = MAX_ID_CHARS if name in _ID_FIELDS else MAX_LABEL_CHARS
            if name in _ID_FIELDS and not value:
                raise InvalidArgument(f"{where}.{name} must not be empty")
            if len(value) > limit:
                raise InvalidArgument(
                    f"{where}.{name} is {len(value)} characters; the limit is {limit}")
            if "\x00" in value:
                raise InvalidArgument(f"{where}.{name} contains a NUL byte")
        if tenants is not None and e.tenant_id not in tenants:
            raise InvalidArgument(f"{where}.tenant_id {e.tenant_id!r} is not a configured tenant")
        for name in COUNT_FIELDS:
            if getattr(e, name) < 0:
                raise InvalidArgument(f"{where}.{name} must be >= 0, got {getattr(e, name)}")
        if e.cached_tokens > e.prompt_tokens:
            raise InvalidArgument(f"{where}.cached_tokens ({e.cached_tokens}) must be <="
                                  f" prompt_tokens ({e.prompt_tokens})")
        for name in ("started_at", "finished_at"):
            check_time(f"{where}.{name}", getattr(e, name))
        oldest, newest = now - self.max_age_seconds, now + self.max_ahead_seconds
        if not oldest <= e.finished_at <= newest:
            raise InvalidArgument(
                f"{where}.finished_at {e.finished_at:.3f} is outside the accepted window"
                f" [{oldest:.0f}, {newest:.0f}] ({self.max_age_seconds:.0f} s back,"
                f" {self.max_ahead_seconds:.0f} s ahead of the meter's clock)")
        if e.finished_at < e.started_at:
            raise InvalidArgument(f"{where}.finished_at must be >= started_at")
        if not math.isfinite(e.energy_joules) or e.energy_joules < 0:
            raise InvalidArgument(f"{where}.energy_joules must be finite and >= 0")


def check_time(name: str, value: float):
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{name} must be a finite number of Unix seconds >= 0, got {value}")


@dataclass(frozen=True)
class RecordResult:
    accepted: int
    duplicates: int
    # source -> events stored for the first time (metrics).
    accepted_by_source: dict[Source, int] = field(default_factory=dict)


@dataclass(frozen=True)
class UsageQuery:
    """Events of `source` finished in [start, end) (None: unbounded), optionally one tenant."""

    tenant_id: str = ""
    start: float | None = None
    end: float | None = None
    group_by: tuple[GroupBy, ...] = ()
    bucket_seconds: int = DEFAULT_BUCKET_SECONDS
    source: Source = Source.GATEWAY

    def __post_init__(self):
        for name in ("start", "end"):
            v = getattr(self, name)
            if v is not None:
                check_time(name, v)
        if self.start is not None and self.end is not None and self.end <= self.start:
            raise InvalidArgument(f"end ({self.end}) must be after start ({self.start})")
        if len(set(self.group_by)) != len(self.group_by):
            raise InvalidArgument("group_by lists a dimension twice")
        if self.bucket_seconds < 1:
            raise InvalidArgument(f"bucket_seconds must be >= 1, got {self.bucket_seconds}")


@dataclass(frozen=True)
class UsageRow:
    keys: tuple[str, ...]
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    energy_joules: float
    # Some of energy_joules is estimated (a watts figure, not a counter).
    energy_estimated: bool = False

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def tokens_per_joule(self) -> float:
        """Tokens per watt-second; 0 when no energy was recorded."""
        return self.total_tokens / self.energy_joules if self.energy_joules > 0 else 0.0


@dataclass(frozen=True)
class Mismatch:
    request_id: str
    # "missing_engine", "missing_gateway" or "mismatch" (then `field` names what differs).
    kind: str
    field: str = ""
    gateway_value: str = ""
    engine_value: str = ""


@dataclass(frozen=True)
class Reconciliation:
    matched: int
    mismatches: tuple[Mismatch, ...]

    def drift(self) -> dict[str, int]:
        """kind -> requests of that kind (a request with two differing fields counts once
        per field)."""
        out: dict[str, int] = {}
        for m in self.mismatches:
            out[m.kind] = out.get(m.kind, 0) + 1
        return out
