"""Plain data of the usage ledger: events, queries, rows, reconciliation results.

No protobuf here: the servicer converts. Validation happens on construction, so a ledger
never sees an event it cannot store; messages name the field and the limit.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from tokenserve.runtime.errors import InvalidArgument

MAX_BATCH_EVENTS = 10_000
MAX_ID_CHARS = 128
MAX_LABEL_CHARS = 256
DEFAULT_BUCKET_SECONDS = 3600


class Source(str, enum.Enum):
    GATEWAY = "gateway"
    ENGINE = "engine"


class GroupBy(str, enum.Enum):
    TENANT = "tenant_id"
    APP = "app"
    MODEL = "model"
    VERSION = "model_version"
    TIER = "tier"
    TIME = "time"


def _check_text(name: str, value: str, limit: int, *, required: bool):
    if required and not value:
        raise InvalidArgument(f"{name} must not be empty")
    if len(value) > limit:
        raise InvalidArgument(f"{name} is {len(value)} characters; the limit is {limit}")


def _check_time(name: str, value: float):
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{name} must be a finite number of Unix seconds >= 0, got {value}")


@dataclass(frozen=True)
class UsageEvent:
    """What one request used, as one source saw it. `where` prefixes error messages
    (e.g. "events[3]") so a caller knows which event of a batch was refused."""

    event_id: str
    request_id: str
    source: Source
    tenant_id: str
    app: str = ""
    model: str = ""
    model_version: str = ""
    tier: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    status: str = "OK"
    started_at: float = 0.0
    finished_at: float = 0.0
    energy_joules: float = 0.0
    energy_estimated: bool = False
    where: str = field(default="event", compare=False, repr=False)

    def __post_init__(self):
        w = self.where
        _check_text(f"{w}.event_id", self.event_id, MAX_ID_CHARS, required=True)
        _check_text(f"{w}.request_id", self.request_id, MAX_ID_CHARS, required=True)
        _check_text(f"{w}.tenant_id", self.tenant_id, MAX_ID_CHARS, required=True)
        for name in ("app", "model", "model_version", "tier", "status"):
            _check_text(f"{w}.{name}", getattr(self, name), MAX_LABEL_CHARS, required=False)
        if not isinstance(self.source, Source):
            raise InvalidArgument(f"{w}.source must be SOURCE_GATEWAY or SOURCE_ENGINE")
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{w}.{name} must be >= 0, got {getattr(self, name)}")
        if self.cached_tokens > self.prompt_tokens:
            raise InvalidArgument(
                f"{w}.cached_tokens ({self.cached_tokens}) must be <= prompt_tokens"
                f" ({self.prompt_tokens})")
        _check_time(f"{w}.started_at", self.started_at)
        _check_time(f"{w}.finished_at", self.finished_at)
        if self.finished_at < self.started_at:
            raise InvalidArgument(f"{w}.finished_at must be >= started_at")
        if not math.isfinite(self.energy_joules) or self.energy_joules < 0:
            raise InvalidArgument(f"{w}.energy_joules must be finite and >= 0")


def check_batch_size(n: int):
    if n > MAX_BATCH_EVENTS:
        raise InvalidArgument(
            f"events holds {n} events; at most {MAX_BATCH_EVENTS} per RecordUsage call")


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
                _check_time(name, v)
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


@dataclass(frozen=True)
class Mismatch:
    request_id: str
    # "missing_engine", "missing_gateway", "prompt_tokens", "completion_tokens"
    kind: str
    gateway_value: int = 0
    engine_value: int = 0


@dataclass(frozen=True)
class Reconciliation:
    matched: int
    mismatches: tuple[Mismatch, ...]
