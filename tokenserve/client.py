"""Python SDK for the tokenserve public API (the gateway's InferenceService).

    from tokenserve.client import Client

    with Client() as client:     # TOKENSERVE_GATEWAY (127.0.0.1:50051), TOKENSERVE_API_KEY
        for chunk in client.chat([{"role": "user", "content": "Hi!"}], max_tokens=32):
            print(chunk.text, end="", flush=True)
        text, usage = client.generate_text("Once upon a time", max_tokens=16, temperature=0.7)
        for row in client.get_usage(group_by=["model", "app"]):   # what this key's tenant used
            print(row.keys, row.requests, row.total_tokens, row.tokens_per_joule)

`AsyncClient` has the same methods as coroutines / async iterators. Every failure raises a
`TokenserveError` subclass carrying the gRPC status code, the server's message and, for
limits, `retry_after` in seconds and the `limit` hit. A call refused with UNAVAILABLE or
RESOURCE_EXHAUSTED before its first token is retried (`RetryPolicy`: the server's
retry-after, capped). Leaving a stream early cancels the request on the server.
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterable, Iterator, Mapping, Sequence

import grpc

from tokenserve.client_errors import (AuthenticationError, DeadlineExceededError,
                                      InvalidRequestError, NotFoundError, PermissionDeniedError,
                                      RateLimitError, RetryPolicy, TokenserveError,
                                      UnavailableError, error_from_rpc)
from tokenserve.common.v1 import common_pb2
from tokenserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tokenserve.meter.v1 import meter_pb2
from tokenserve.sampling import FIELDS as _SAMPLING

__all__ = ["Client", "AsyncClient", "Chunk", "Usage", "ModelInfo", "UsageRow", "GROUP_BY",
           "RetryPolicy",
           "TokenserveError", "AuthenticationError", "PermissionDeniedError",
           "InvalidRequestError", "NotFoundError", "RateLimitError", "UnavailableError",
           "DeadlineExceededError"]

DEFAULT_MAX_TOKENS = 128
DEFAULT_GATEWAY = "127.0.0.1:50051"
# Where Client() finds its gateway and key when none is passed.
GATEWAY_ENV, API_KEY_ENV = "TOKENSERVE_GATEWAY", "TOKENSERVE_API_KEY"
# The sampling controls GenerateRequest and ChatRequest also carry as top-level fields.
_TOP_LEVEL = tuple(f for f in _SAMPLING
                   if f in gateway_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)
_OPTIONS = ("stop", "request_id", "app", "logprobs", "top_logprobs", "speculation")
_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_CANCELLED: "cancelled", common_pb2.FINISH_REASON_ERROR: "error"}
# get_usage's dimensions: "tenant", "app", "model", "version", "tier", "time" (the proto's
# GroupBy values, named without their prefix).
GROUP_BY: Mapping[str, int] = {name.removeprefix("GROUP_BY_").lower(): value
                               for name, value in meter_pb2.GroupBy.items() if value}


# -- results ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Chunk:
    """One streamed message. The last one has `finish_reason` ("stop", "length", ...) and
    `usage` set; `request_id` is on the first and the last."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None
    request_id: str = ""
    model_version: str = ""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    # version -> traffic weight
    versions: Mapping[str, int]
    max_context: int


@dataclass(frozen=True)
class UsageRow:
    """Billed usage of one group (or of everything, with no group_by), as the meter sums it."""

    # The values of the group_by dimensions, in the order asked for (a time bucket is its
    # start in Unix seconds, as a string).
    keys: tuple[str, ...]
    # Distinct requests.
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # prompt_tokens + completion_tokens.
    total_tokens: int
    energy_joules: float
    # total_tokens / energy_joules; 0 when no energy was recorded.
    tokens_per_joule: float
    # Some of energy_joules is an estimate (a configured watts figure, not a counter).
    energy_estimated: bool


def _chunk(resp: gateway_pb2.GenerateResponse) -> Chunk:
    last = resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    usage = (Usage(resp.usage.prompt_tokens, resp.usage.completion_tokens,
                   resp.usage.cached_tokens) if last else None)
    return Chunk(text=resp.text, token_ids=tuple(resp.token_ids),
                 finish_reason=_FINISH.get(resp.finish_reason) if last else None, usage=usage,
                 request_id=resp.request_id, model_version=resp.model_version)


# -- requests -----------------------------------------------------------------------------

def _fill(req, model: str, max_tokens: int, options: dict) -> None:
    unknown = set(options) - set(_SAMPLING) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; allowed: "
                        f"{', '.join(_SAMPLING + _OPTIONS)}")
    req.model = model
    req.max_tokens = max_tokens
    for name, value in options.items():
        if value is None:
            continue
        if name in _TOP_LEVEL:
            setattr(req, name, value)
        elif name in _SAMPLING:
            setattr(req.sampling, name, value)
        elif name == "stop":
            req.stop.extend([value] if isinstance(value, str) else value)
        else:
            setattr(req, name, value)


def _messages(messages: Iterable) -> list[common_pb2.ChatMessage]:
    out = []
    for m in messages:
        role, content = (m["role"], m["content"]) if isinstance(m, Mapping) else m
        out.append(common_pb2.ChatMessage(role=role, content=content))
    return out


def _generate_request(prompt: str, model: str, max_tokens: int, options: dict):
    req = gateway_pb2.GenerateRequest(prompt=prompt)
    _fill(req, model, max_tokens, options)
    return req


def _chat_request(messages: Iterable, model: str, max_tokens: int, options: dict):
    req = gateway_pb2.ChatRequest(messages=_messages(messages))
    _fill(req, model, max_tokens, options)
    return req


def _count_request(prompt: str | None, messages: Iterable | None, model: str):
    if (prompt is None) == (messages is None):
        raise TypeError("count_tokens takes exactly one of prompt= or messages=")
    if prompt is not None:
        return gateway_pb2.CountTokensRequest(model=model, prompt=prompt)
    return gateway_pb2.CountTokensRequest(
        model=model, chat=gateway_pb2.ChatMessages(messages=_messages(messages)))


def _models(resp: gateway_pb2.ListModelsResponse) -> list[ModelInfo]:
    return [ModelInfo(m.name, {v.version: v.weight for v in m.versions}, m.max_context)
            for m in resp.models]


def _usage_request(group_by: Sequence[str], start: float, end: float, bucket_seconds: int,
                   tenant_id: str) -> gateway_pb2.GetUsageRequest:
    if isinstance(group_by, str):
        group_by = (group_by,)
    unknown = [g for g in group_by if g not in GROUP_BY]
    if unknown:
        raise ValueError(f"unknown group_by {', '.join(map(repr, unknown))}; allowed: "
                         f"{', '.join(GROUP_BY)}")
    return gateway_pb2.GetUsageRequest(tenant_id=tenant_id, start=start, end=end,
                                       group_by=[GROUP_BY[g] for g in group_by],
                                       bucket_seconds=bucket_seconds)


def _usage_rows(resp: gateway_pb2.GetUsageResponse) -> list[UsageRow]:
    return [UsageRow(keys=tuple(r.keys), requests=r.requests, prompt_tokens=r.prompt_tokens,
                     completion_tokens=r.completion_tokens, cached_tokens=r.cached_tokens,
                     total_tokens=r.total_tokens, energy_joules=r.energy_joules,
                     tokens_per_joule=r.tokens_per_joule, energy_estimated=r.energy_estimated)
            for r in resp.rows]


def _collect(chunks: Sequence[Chunk]) -> tuple[str, Usage]:
    usage = chunks[-1].usage if chunks and chunks[-1].usage else Usage(0, 0, 0)
    return "".join(c.text for c in chunks), usage


# -- clients ------------------------------------------------------------------------------

def _left(deadline: float) -> float:
    """Seconds until `deadline` (a tiny positive number once past: grpc then reports
    DEADLINE_EXCEEDED itself)."""
    return max(0.001, deadline - time.monotonic())


def _connection(target: str | None, api_key: str | None) -> tuple[str, tuple]:
    """The gateway address and the call metadata, from the arguments or the environment."""
    key = api_key or os.environ.get(API_KEY_ENV)
    if not key:
        raise ValueError(f"no API key: pass api_key= or set {API_KEY_ENV}")
    return (target or os.environ.get(GATEWAY_ENV) or DEFAULT_GATEWAY,
            (("authorization", f"Bearer {key}"),))


def _tls_credentials(tls_ca: str | None, tls_cert: str | None,
                     tls_key: str | None) -> grpc.ChannelCredentials | None:
    """TLS to the gateway when `tls_ca` (a PEM file) is given; `tls_cert`/`tls_key`: a client
    certificate, for a gateway that requires one."""
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key must be given together")
    if tls_ca is None:
        if tls_cert is not None:
            raise ValueError("a client certificate needs tls_ca (the gateway's CA)")
        return None

    def read(path):
        return None if path is None else Path(path).read_bytes()
    return grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))


class Client:
    """Blocking client. `target` and `api_key` default to $TOKENSERVE_GATEWAY (else
    127.0.0.1:50051) and $TOKENSERVE_API_KEY; `timeout` (seconds) is the deadline of each call,
    retries included; `model` the default model ("" lets the gateway choose); `retry` when
    and how often a refused call is tried again; `tls_ca` (a PEM file): connect with TLS,
    verifying the gateway with that CA (`tls_cert`/`tls_key`: a client certificate)."""

    def __init__(self, target: str | None = None, api_key: str | None = None,
                 timeout: float = 30.0, *, model: str = "", channel: grpc.Channel | None = None,
                 retry: RetryPolicy | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None):
        target, self._metadata = _connection(target, api_key)
        creds = _tls_credentials(tls_ca, tls_cert, tls_key)
        self._channel = channel or (grpc.insecure_channel(target) if creds is None
                                    else grpc.secure_channel(target, creds))
        self._stub = gateway_pb2_grpc.InferenceServiceStub(self._channel)
        self.timeout = timeout
        self.model = model
        self.retry = retry or RetryPolicy()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _stream(self, method, req) -> Iterator[Chunk]:
        deadline, attempt = time.monotonic() + self.timeout, 0
        while True:
            call = method(req, metadata=self._metadata, timeout=_left(deadline))
            started = False
            try:
                for resp in call:
                    started = True
                    yield _chunk(resp)
                return
            except grpc.RpcError as e:
                err, attempt = error_from_rpc(e), attempt + 1
                wait = None if started else self.retry.wait(err, attempt, _left(deadline))
                if wait is None:
                    raise err from None
            finally:
                call.cancel()  # no-op when finished; stops the server's work when left early
            time.sleep(wait)

    def _unary(self, method, req):
        deadline, attempt = time.monotonic() + self.timeout, 0
        while True:
            try:
                return method(req, metadata=self._metadata, timeout=_left(deadline))
            except grpc.RpcError as e:
                err, attempt = error_from_rpc(e), attempt + 1
                wait = self.retry.wait(err, attempt, _left(deadline))
                if wait is None:
                    raise err from None
            time.sleep(wait)

    def generate(self, prompt: str, *, model: str | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS, **options) -> Iterator[Chunk]:
        """Streams the completion of `prompt`. Options: temperature, top_p, top_k, seed,
        min_p, repetition_penalty, presence_penalty, frequency_penalty, stop, request_id,
        app, logprobs, top_logprobs, speculation (False: no drafting for this request)."""
        req = _generate_request(prompt, self.model if model is None else model, max_tokens,
                                options)
        return self._stream(self._stub.Generate, req)

    def generate_text(self, prompt: str, **kw) -> tuple[str, Usage]:
        return _collect(list(self.generate(prompt, **kw)))

    def chat(self, messages: Iterable, *, model: str | None = None,
             max_tokens: int = DEFAULT_MAX_TOKENS, **options) -> Iterator[Chunk]:
        """Streams the assistant's reply. `messages`: dicts with role and content (or
        (role, content) pairs); same options as `generate`."""
        req = _chat_request(messages, self.model if model is None else model, max_tokens,
                            options)
        return self._stream(self._stub.Chat, req)

    def chat_text(self, messages: Iterable, **kw) -> tuple[str, Usage]:
        return _collect(list(self.chat(messages, **kw)))

    def count_tokens(self, prompt: str | None = None, *, messages: Iterable | None = None,
                     model: str | None = None) -> int:
        req = _count_request(prompt, messages, self.model if model is None else model)
        return self._unary(self._stub.CountTokens, req).count

    def list_models(self) -> list[ModelInfo]:
        return _models(self._unary(self._stub.ListModels, gateway_pb2.ListModelsRequest()))

    def get_usage(self, *, group_by: Sequence[str] = (), start: float = 0, end: float = 0,
                  bucket_seconds: int = 0, tenant_id: str = "") -> list[UsageRow]:
        """This key's tenant's billed usage of requests finished in [start, end) (Unix
        seconds; 0: unbounded), one row per group of `group_by` (names from `GROUP_BY`, each
        at most once; none: one total row, or no row when nothing was used), ordered by their
        keys. `bucket_seconds`: the width of "time" buckets (0: the server's 3600).
        `tenant_id`: empty or this key's own tenant (another one is PermissionDeniedError)."""
        req = _usage_request(group_by, start, end, bucket_seconds, tenant_id)
        return _usage_rows(self._unary(self._stub.GetUsage, req))


class AsyncClient:
    """asyncio client with the same arguments and methods as `Client` (streams are async
    iterators)."""

    def __init__(self, target: str | None = None, api_key: str | None = None,
                 timeout: float = 30.0, *, model: str = "",
                 channel: grpc.aio.Channel | None = None, retry: RetryPolicy | None = None,
                 tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None):
        target, self._metadata = _connection(target, api_key)
        creds = _tls_credentials(tls_ca, tls_cert, tls_key)
        self._channel = channel or (grpc.aio.insecure_channel(target) if creds is None
                                    else grpc.aio.secure_channel(target, creds))
        self._stub = gateway_pb2_grpc.InferenceServiceStub(self._channel)
        self.timeout = timeout
        self.model = model
        self.retry = retry or RetryPolicy()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _stream(self, method, req) -> AsyncIterator[Chunk]:
        deadline, attempt = time.monotonic() + self.timeout, 0
        while True:
            call = method(req, metadata=self._metadata, timeout=_left(deadline))
            started = False
            try:
                async for resp in call:
                    started = True
                    yield _chunk(resp)
                return
            except grpc.RpcError as e:
                err, attempt = error_from_rpc(e), attempt + 1
                wait = None if started else self.retry.wait(err, attempt, _left(deadline))
                if wait is None:
                    raise err from None
            finally:
                call.cancel()
            await asyncio.sleep(wait)

    async def _unary(self, method, req):
        deadline, attempt = time.monotonic() + self.timeout, 0
        while True:
            try:
                return await method(req, metadata=self._metadata, timeout=_left(deadline))
            except grpc.RpcError as e:
                err, attempt = error_from_rpc(e), attempt + 1
                wait = self.retry.wait(err, attempt, _left(deadline))
                if wait is None:
                    raise err from None
            await asyncio.sleep(wait)

    def generate(self, prompt: str, *, model: str | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS, **options) -> AsyncIterator[Chunk]:
        req = _generate_request(prompt, self.model if model is None else model, max_tokens,
                                options)
        return self._stream(self._stub.Generate, req)

    async def generate_text(self, prompt: str, **kw) -> tuple[str, Usage]:
        return _collect([c async for c in self.generate(prompt, **kw)])

    def chat(self, messages: Iterable, *, model: str | None = None,
             max_tokens: int = DEFAULT_MAX_TOKENS, **options) -> AsyncIterator[Chunk]:
        req = _chat_request(messages, self.model if model is None else model, max_tokens,
                            options)
        return self._stream(self._stub.Chat, req)

    async def chat_text(self, messages: Iterable, **kw) -> tuple[str, Usage]:
        return _collect([c async for c in self.chat(messages, **kw)])

    async def count_tokens(self, prompt: str | None = None, *, messages: Iterable | None = None,
                           model: str | None = None) -> int:
        req = _count_request(prompt, messages, self.model if model is None else model)
        return (await self._unary(self._stub.CountTokens, req)).count

    async def list_models(self) -> list[ModelInfo]:
        return _models(await self._unary(self._stub.ListModels, gateway_pb2.ListModelsRequest()))

    async def get_usage(self, *, group_by: Sequence[str] = (), start: float = 0,
                        end: float = 0, bucket_seconds: int = 0,
                        tenant_id: str = "") -> list[UsageRow]:
        req = _usage_request(group_by, start, end, bucket_seconds, tenant_id)
        return _usage_rows(await self._unary(self._stub.GetUsage, req))
