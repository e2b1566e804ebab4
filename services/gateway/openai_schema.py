"""The OpenAI-compatible wire format: request bodies (pydantic), their conversion to the
pipeline's `InferenceRequest`, and the OpenAPI document that is the HTTP front's contract.

Parsing checks only shapes and types (a 400 naming the field); every range and limit is
checked once, by `validation.validate`, for both adapters. The sampling fields of a body are
derived from `tokenserve.sampling` (names through `OPENAI_NAMES`, types from the dataclass).
"""
from __future__ import annotations

from typing import Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from services.gateway.validation import CHAT_ROLES, InferenceRequest, Message
from tokenserve.runtime.errors import InvalidArgument
from tokenserve.sampling import FIELDS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, SamplingParams

# OpenAI's newer name for the system role.
_ROLE_ALIASES = {"developer": "system"}
Role = Literal[CHAT_ROLES + tuple(_ROLE_ALIASES)]  # type: ignore[valid-type]


class _Body(BaseModel):
    # Unknown fields are ignored, as most OpenAI-compatible servers do: clients send
    # vendor extensions (e.g. `metadata`, `store`) that change nothing here.
    model_config = ConfigDict(extra="ignore")


# Each sampling control (tokenserve.sampling.FIELDS) is either set by the OpenAI body field
# named here, or listed in NOT_OVER_HTTP; a test checks every control is one or the other, so a
# new control needs a decision here and nothing else (the body field and conversion follow).
OPENAI_NAMES: dict[str, str] = {  # control -> OpenAI's name for it
    "temperature": "temperature", "top_p": "top_p", "seed": "seed",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# OpenAI's API has no such field: set them through the gRPC API; over HTTP they keep their
# defaults (a body that sends one has it ignored, as any unknown field).
NOT_OVER_HTTP = frozenset({"top_k", "min_p", "repetition_penalty"})
_DESCRIPTIONS = {"temperature": "0 is greedy"}
_TYPES = get_type_hints(SamplingParams)

# One optional body field per exposed control; None: the control keeps its default.
_SamplingBody = create_model(
    "_SamplingBody", __base__=_Body,
    **{OPENAI_NAMES[name]: (_TYPES[name] | None,
                            Field(None, description=_DESCRIPTIONS.get(name)))
       for name in FIELDS if name in OPENAI_NAMES})


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Role
    content: str | list[TextPart] | None = Field(
        None, description="the text, or a list of text parts (joined)")
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool | None = Field(
        None, description="send one last chunk with `usage` and `choices: []`")


class _Generation(_SamplingBody):
    model: str = Field("", description="model name; empty: the gateway's default model")
    max_tokens: int | None = Field(
        None, description="tokens to generate at most; default: the tier's cap")
    stop: str | list[str] | None = Field(
        None, description=f"up to {MAX_STOP_STRINGS} stop strings")
    n: int | None = Field(None, description="only 1 is supported")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(
        None, description="end-user label, recorded as the usage record's app (<= 64 chars)")
    # tokenserve extension, as the gRPC API's `speculation` field
    speculation: bool | None = Field(
        None, description="tokenserve extension: false turns speculative decoding (prompt-lookup"
                          " drafts) off for this request; unset: the engine's setting. The output"
                          " is the same either way (greedy: token for token), only its speed"
                          " differs")


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(
        None, description="the newer name of max_tokens; wins when both are set")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(
        None, description=f"alternatives per token, 0-{MAX_TOP_LOGPROBS}")


class CompletionRequest(_Generation):
    prompt: str | list[str] = Field(description="the text (a list must hold exactly one)")
    logprobs: int | None = Field(
        None, description=f"alternatives per token, 0-{MAX_TOP_LOGPROBS} (the completions"
                          " API's form)")
    echo: bool | None = Field(None, description="only false is supported")


def _check_n(n: int | None) -> None:
    if n is not None and n != 1:
        raise InvalidArgument(f"n must be 1 (one choice per request), got {n}")


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _content(m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    return "".join(part.text for part in m.content)


def _sampling(body: _Generation) -> SamplingParams:
    """The controls the body sets; unset ones keep the gRPC API's defaults (greedy)."""
    given = {name: getattr(body, wire) for name, wire in OPENAI_NAMES.items()}
    return SamplingParams(**{k: v for k, v in given.items() if v is not None})


def chat_request(body: ChatCompletionRequest, *, default_max_tokens: int,
                 request_id: str) -> InferenceRequest:
    _check_n(body.n)
    max_tokens = (body.max_tokens if body.max_completion_tokens is None
                  else body.max_completion_tokens)
    messages = tuple(Message(role=_ROLE_ALIASES.get(m.role, m.role), content=_content(m))
                     for m in body.messages)
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise InvalidArgument("top_logprobs needs logprobs: true")
    return InferenceRequest(
        model=body.model, max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        messages=messages, sampling=_sampling(body), stop=_stop(body.stop),
        request_id=request_id, app=body.user or "", logprobs=bool(body.logprobs),
        top_logprobs=top, speculation=body.speculation)


def completion_request(body: CompletionRequest, *, default_max_tokens: int,
                       request_id: str) -> InferenceRequest:
    _check_n(body.n)
    if body.echo:
        raise InvalidArgument("echo must be false (the prompt is not returned)")
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise InvalidArgument(
                f"prompt must be a string or a list of exactly one, got {len(prompt)} prompts")
        prompt = prompt[0]
    return InferenceRequest(
        model=body.model,
        max_tokens=default_max_tokens if body.max_tokens is None else body.max_tokens,
        prompt=prompt, sampling=_sampling(body), stop=_stop(body.stop), request_id=request_id,
        app=body.user or "", logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0, speculation=body.speculation)


# -- the OpenAPI document ----------------------------------------------------------------

_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}}}
_USAGE_SCHEMA = {
    "type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {"prompt_tokens": {"type": "integer"},
                   "completion_tokens": {"type": "integer"},
                   "total_tokens": {"type": "integer"},
                   "prompt_tokens_details": {"type": "object", "properties": {
                       "cached_tokens": {"type": "integer"}}}}}
_COMPLETION_SCHEMA = {
    "type": "object", "required": ["id", "object", "created", "model", "choices"],
    "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                   "created": {"type": "integer"}, "model": {"type": "string"},
                   "system_fingerprint": {"type": "string"},
                   "choices": {"type": "array", "items": {"type": "object"}},
                   "usage": {"$ref": "#/components/schemas/Usage"}}}
_MODELS_SCHEMA = {
    "type": "object", "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
        "type": "object", "required": ["id", "object", "created", "owned_by"],
        "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                       "created": {"type": "integer"}, "owned_by": {"type": "string"},
                       "max_context": {"type": "integer"},
                       "versions": {"type": "object",
                                    "additionalProperties": {"type": "integer"}}}}}}}
# status -> why, for every operation that takes a key.
_ERRORS = {"400": "a field is missing, malformed or out of range (`param` names it)",
           "401": "missing, unknown or revoked API key",
           "403": "the key's tenant is disabled",
           "404": "unknown model",
           "413": "the request body is over the gateway's message size limit (16 MiB)",
           "429": "a rate limit, quota or load shedding; see Retry-After",
           "503": "no engine can take the request now",
           "504": "the request ran past its deadline"}


def _responses(ok: dict[str, Any], *, errors: tuple[str, ...]) -> dict[str, Any]:
    out = {"200": ok}
    for status in errors:
        out[status] = {"description": _ERRORS[status], "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return out


def _generation_op(summary: str, request: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "security": [{"bearer": []}],
        "parameters": [{"name": "x-request-id", "in": "header", "required": False,
                        "description": "your id for the request (1-128 of A-Z a-z 0-9 . _ : -)",
                        "schema": {"type": "string"}}],
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{request}"}}}},
        "responses": _responses({"description": "the completion, or with `stream: true` "
                                                "server-sent events ending `data: [DONE]`",
                                 "content": {
                                     "application/json": {"schema": {
                                         "$ref": "#/components/schemas/Completion"}},
                                     "text/event-stream": {"schema": {"type": "string"}}}},
                                errors=tuple(_ERRORS))}


def openapi_document(title: str, version: str) -> dict[str, Any]:
    from pydantic.json_schema import models_json_schema

    _, defs = models_json_schema(
        [(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
        ref_template="#/components/schemas/{model}")
    schemas = dict(defs["$defs"])
    schemas.update(Error=_ERROR_SCHEMA, Usage=_USAGE_SCHEMA, Completion=_COMPLETION_SCHEMA,
                   ModelList=_MODELS_SCHEMA)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": {
            "/v1/chat/completions": {"post": _generation_op("Chat completion",
                                                            "ChatCompletionRequest")},
            "/v1/completions": {"post": _generation_op("Text completion",
                                                       "CompletionRequest")},
            "/v1/models": {"get": {
                "summary": "Models this gateway routes to",
                "security": [{"bearer": []}],
                "responses": _responses({"description": "the models", "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ModelList"}}}},
                    errors=("401", "403"))}},
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "an API key, ts-..."}}},
    }
