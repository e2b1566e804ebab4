from tokenserve.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("model", "text", "chat", "add_generation_prompt", "add_special_tokens", "parse_special")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARSE_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    chat: ChatMessages
    add_generation_prompt: bool
    add_special_tokens: bool
    parse_special: bool
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., add_generation_prompt: _Optional[bool] = ..., add_special_tokens: _Optional[bool] = ..., parse_special: _Optional[bool] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("token_ids", "rendered_chars")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RENDERED_CHARS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    rendered_chars: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., rendered_chars: _Optional[int] = ...) -> None: ...

class EncodeBatchRequest(_message.Message):
    __slots__ = ("model", "requests")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    requests: _containers.RepeatedCompositeFieldContainer[EncodeRequest]
    def __init__(self, model: _Optional[str] = ..., requests: _Optional[_Iterable[_Union[EncodeRequest, _Mapping]]] = ...) -> None: ...

class EncodeBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EncodeResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[EncodeResponse, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("model", "token_ids", "skip_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class DecodeBatchRequest(_message.Message):
    __slots__ = ("model", "requests")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    requests: _containers.RepeatedCompositeFieldContainer[DecodeRequest]
    def __init__(self, model: _Optional[str] = ..., requests: _Optional[_Iterable[_Union[DecodeRequest, _Mapping]]] = ...) -> None: ...

class DecodeBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DecodeResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[DecodeResponse, _Mapping]]] = ...) -> None: ...

class CountTokensResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class CountTokensBatchResponse(_message.Message):
    __slots__ = ("counts",)
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, counts: _Optional[_Iterable[int]] = ...) -> None: ...

class GetTokenizerInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetTokenizerInfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "bos_token_id", "eos_token_id", "special_token_ids", "has_chat_template", "max_text_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXT_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    special_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_chat_template: bool
    max_text_bytes: int
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., special_token_ids: _Optional[_Iterable[int]] = ..., has_chat_template: _Optional[bool] = ..., max_text_bytes: _Optional[int] = ...) -> None: ...
