from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Source(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SOURCE_UNSPECIFIED: _ClassVar[Source]
    SOURCE_GATEWAY: _ClassVar[Source]
    SOURCE_ENGINE: _ClassVar[Source]

class GroupBy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_BY_UNSPECIFIED: _ClassVar[GroupBy]
    GROUP_BY_TENANT: _ClassVar[GroupBy]
    GROUP_BY_APP: _ClassVar[GroupBy]
    GROUP_BY_MODEL: _ClassVar[GroupBy]
    GROUP_BY_VERSION: _ClassVar[GroupBy]
    GROUP_BY_TIER: _ClassVar[GroupBy]
    GROUP_BY_TIME: _ClassVar[GroupBy]
SOURCE_UNSPECIFIED: Source
SOURCE_GATEWAY: Source
SOURCE_ENGINE: Source
GROUP_BY_UNSPECIFIED: GroupBy
GROUP_BY_TENANT: GroupBy
GROUP_BY_APP: GroupBy
GROUP_BY_MODEL: GroupBy
GROUP_BY_VERSION: GroupBy
GROUP_BY_TIER: GroupBy
GROUP_BY_TIME: GroupBy

class UsageEvent(_message.Message):
    __slots__ = ("event_id", "request_id", "source", "tenant_id", "app", "model", "model_version", "tier", "prompt_tokens", "completion_tokens", "cached_tokens", "status", "finish_reason", "preempted", "cancelled", "started_at", "finished_at", "energy_joules", "energy_estimated")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    APP_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    ENERGY_JOULES_FIELD_NUMBER: _ClassVar[int]
    ENERGY_ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    request_id: str
    source: Source
    tenant_id: str
    app: str
    model: str
    model_version: str
    tier: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    status: str
    finish_reason: str
    preempted: bool
    cancelled: bool
    started_at: float
    finished_at: float
    energy_joules: float
    energy_estimated: bool
    def __init__(self, event_id: _Optional[str] = ..., request_id: _Optional[str] = ..., source: _Optional[_Union[Source, str]] = ..., tenant_id: _Optional[str] = ..., app: _Optional[str] = ..., model: _Optional[str] = ..., model_version: _Optional[str] = ..., tier: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., status: _Optional[str] = ..., finish_reason: _Optional[str] = ..., preempted: _Optional[bool] = ..., cancelled: _Optional[bool] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., energy_joules: _Optional[float] = ..., energy_estimated: _Optional[bool] = ...) -> None: ...

class RecordUsageRequest(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[UsageEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[UsageEvent, _Mapping]]] = ...) -> None: ...

class RecordUsageResponse(_message.Message):
    __slots__ = ("accepted", "duplicates")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class QueryUsageRequest(_message.Message):
    __slots__ = ("tenant_id", "start", "end", "group_by", "bucket_seconds", "source")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    GROUP_BY_FIELD_NUMBER: _ClassVar[int]
    BUCKET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    start: float
    end: float
    group_by: _containers.RepeatedScalarFieldContainer[GroupBy]
    bucket_seconds: int
    source: Source
    def __init__(self, tenant_id: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ..., group_by: _Optional[_Iterable[_Union[GroupBy, str]]] = ..., bucket_seconds: _Optional[int] = ..., source: _Optional[_Union[Source, str]] = ...) -> None: ...

class UsageRow(_message.Message):
    __slots__ = ("keys", "requests", "prompt_tokens", "completion_tokens", "cached_tokens", "energy_joules", "total_tokens", "tokens_per_joule", "energy_estimated")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENERGY_JOULES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_JOULE_FIELD_NUMBER: _ClassVar[int]
    ENERGY_ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    energy_joules: float
    total_tokens: int
    tokens_per_joule: float
    energy_estimated: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., energy_joules: _Optional[float] = ..., total_tokens: _Optional[int] = ..., tokens_per_joule: _Optional[float] = ..., energy_estimated: _Optional[bool] = ...) -> None: ...

class QueryUsageResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[UsageRow]
    def __init__(self, rows: _Optional[_Iterable[_Union[UsageRow, _Mapping]]] = ...) -> None: ...

class ReconcileRequest(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: float
    end: float
    def __init__(self, start: _Optional[float] = ..., end: _Optional[float] = ...) -> None: ...

class Mismatch(_message.Message):
    __slots__ = ("request_id", "kind", "field", "gateway_value", "engine_value")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_VALUE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VALUE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kind: str
    field: str
    gateway_value: str
    engine_value: str
    def __init__(self, request_id: _Optional[str] = ..., kind: _Optional[str] = ..., field: _Optional[str] = ..., gateway_value: _Optional[str] = ..., engine_value: _Optional[str] = ...) -> None: ...

class ReconcileResponse(_message.Message):
    __slots__ = ("matched", "mismatches")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    matched: int
    mismatches: _containers.RepeatedCompositeFieldContainer[Mismatch]
    def __init__(self, matched: _Optional[int] = ..., mismatches: _Optional[_Iterable[_Union[Mismatch, _Mapping]]] = ...) -> None: ...

class ExportChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: str
    def __init__(self, data: _Optional[str] = ...) -> None: ...
