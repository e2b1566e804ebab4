from tokenserve.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "top_logprobs", "logprobs", "priority", "tenant_id", "speculation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    top_logprobs: int
    logprobs: bool
    priority: int
    tenant_id: str
    speculation: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., logprobs: _Optional[bool] = ..., priority: _Optional[int] = ..., tenant_id: _Optional[str] = ..., speculation: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "timings", "logprobs", "energy_joules", "energy_estimated")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENERGY_JOULES_FIELD_NUMBER: _ClassVar[int]
    ENERGY_ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    energy_joules: float
    energy_estimated: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., energy_joules: _Optional[float] = ..., energy_estimated: _Optional[bool] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model", "version", "max_context", "vocab_size", "device", "dtype", "kv_block_size", "kv_blocks_total", "kv_blocks_free", "running", "waiting", "max_concurrency")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    max_context: int
    vocab_size: int
    device: str
    dtype: str
    kv_block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    running: int
    waiting: int
    max_concurrency: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., max_context: _Optional[int] = ..., vocab_size: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_block_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., max_concurrency: _Optional[int] = ...) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("model", "version", "waiting", "running", "kv_blocks_used", "kv_blocks_total", "ttft_p50_seconds", "ttft_p99_seconds", "itl_p50_seconds", "itl_p99_seconds", "tokens_per_second", "watts", "watts_estimated", "latency_window_seconds", "rate_window_seconds", "max_concurrency")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ITL_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ITL_P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WATTS_FIELD_NUMBER: _ClassVar[int]
    WATTS_ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    LATENCY_WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RATE_WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    ttft_p50_seconds: float
    ttft_p99_seconds: float
    itl_p50_seconds: float
    itl_p99_seconds: float
    tokens_per_second: float
    watts: float
    watts_estimated: bool
    latency_window_seconds: float
    rate_window_seconds: float
    max_concurrency: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., ttft_p50_seconds: _Optional[float] = ..., ttft_p99_seconds: _Optional[float] = ..., itl_p50_seconds: _Optional[float] = ..., itl_p99_seconds: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., watts: _Optional[float] = ..., watts_estimated: _Optional[bool] = ..., latency_window_seconds: _Optional[float] = ..., rate_window_seconds: _Optional[float] = ..., max_concurrency: _Optional[int] = ...) -> None: ...
