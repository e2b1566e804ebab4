"""Python SDK for the tokenserve public API (the gateway's InferenceService).

    from tokenserve.client import Client

    with Client("127.0.0.1:50051", api_key="ts-...") as client:
        for chunk in client.chat([{"role": "user", "content": "Hi!"}], max_tokens=32):
            print(chunk.text, end="", flush=True)
        text, usage = client.generate_text("Once upon a time", max_tokens=16, temperature=0.7)

`AsyncClient` has the same methods as coroutines / async iterators. Every failure raises a
`TokenserveError` subclass carrying the gRPC status code, the server's message and, for
limits, `retry_after` in seconds. Leaving a stream early cancels the request on the server.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Iterable, Iterator, Mapping, Sequence

import grpc

from tokenserve.common.v1 import common_pb2
from tokenserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc

__all__ = ["Client", "AsyncClient", "Chunk", "Usage", "ModelInfo", "TokenserveError",
           "AuthenticationError", "PermissionDeniedError", "InvalidRequestError",
           "NotFoundError", "RateLimitError", "UnavailableError", "DeadlineExceededError"]

DEFAULT_MAX_TOKENS = 128
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty")
_TOP_LEVEL = ("temperature", "top_p", "top_k", "seed")
_OPTIONS = ("stop", "request_id", "app", "logprobs", "top_logprobs", "speculation")
_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_CANCELLED: "cancelled", common_pb2.FINISH_REASON_ERROR: "error"}


# -- errors -------------------------------------------------------------------------------

class TokenserveError(Exception):
    """A failed call: `code` (grpc.StatusCode), `message`, `retry_after` (seconds or None)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after = retry_after


class AuthenticationError(TokenserveError):
    """Missing, unknown or revoked API key (UNAUTHENTICATED)."""


class PermissionDeniedError(TokenserveError):
    """The key is valid but may not do this, e.g. its tenant is disabled (PERMISSION_DENIED)."""


class InvalidRequestError(TokenserveError):
    """A field is out of range; the message names it (INVALID_ARGUMENT)."""


class NotFoundError(TokenserveError):
    """Unknown model; the message lists the available ones (NOT_FOUND)."""


class RateLimitError(TokenserveError):
    """A limit or quota was hit; wait `retry_after` seconds (RESOURCE_EXHAUSTED)."""


class UnavailableError(TokenserveError):
    """No engine or service could take the request now; retrying later may work."""


class DeadlineExceededError(TokenserveError):
    """The call ran past its timeout."""


_ERRORS = {
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RateLimitError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


def _error(err: grpc.RpcError) -> TokenserveError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or code.name
    retry_after = None
    try:
        trailing = dict(err.trailing_metadata() or ())
        if "retry-after-ms" in trailing:
            retry_after = float(trailing["retry-after-ms"]) / 1000
    except (AttributeError, TypeError, ValueError):
        pass
    return _ERRORS.get(code, TokenserveError)(code, details, retry_after)


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


def _collect(chunks: Sequence[Chunk]) -> tuple[str, Usage]:
    usage = chunks[-1].usage if chunks and chunks[-1].usage else Usage(0, 0, 0)
    return "".join(c.text for c in chunks), usage


# -- clients ------------------------------------------------------------------------------

class Client:
    """Blocking client. `timeout` (seconds) is the deadline of each call; `model` the
    default model ("" lets the gateway choose)."""

    def __init__(self, target: str, api_key: str, timeout: float = 30.0, *, model: str = "",
                 channel: grpc.Channel | None = None):
        self._channel = channel or grpc.insecure_channel(target)
        self._stub = gateway_pb2_grpc.InferenceServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),)
        self.timeout = timeout
        self.model = model

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _stream(self, method, req) -> Iterator[Chunk]:
        call = method(req, metadata=self._metadata, timeout=self.timeout)
        try:
            for resp in call:
                yield _chunk(resp)
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            call.cancel()  # no-op when finished; stops the server's work when left early

    def _unary(self, method, req):
        try:
            return method(req, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _error(e) from None

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


class AsyncClient:
    """asyncio client with the same methods as `Client` (streams are async iterators)."""

    def __init__(self, target: str, api_key: str, timeout: float = 30.0, *, model: str = "",
                 channel: grpc.aio.Channel | None = None):
        self._channel = channel or grpc.aio.insecure_channel(target)
        self._stub = gateway_pb2_grpc.InferenceServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),)
        self.timeout = timeout
        self.model = model

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _stream(self, method, req) -> AsyncIterator[Chunk]:
        call = method(req, metadata=self._metadata, timeout=self.timeout)
        try:
            async for resp in call:
                yield _chunk(resp)
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            call.cancel()

    async def _unary(self, method, req):
        try:
            return await method(req, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _error(e) from None

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
