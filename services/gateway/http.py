"""The OpenAI-compatible HTTP front: the second adapter over the gateway's pipeline.

    POST /v1/chat/completions, POST /v1/completions (JSON, or SSE with `stream: true`),
    GET /v1/models, GET /openapi.json (the contract), GET /health.

Same keys, validation, admission, routing and metering as the gRPC servicer: this module only
converts HTTP to `InferenceRequest` and `Chunk`s to OpenAI's shapes. Served by uvicorn in the
gateway's own event loop (Starlette: measured in bench/asgi_stack.py, 0.04 ms over a bare ASGI
app per request where FastAPI adds 0.16 ms; the same per streamed token). Errors before the
first token get their HTTP status; an error after it ends the stream with an `error` event.
A client that goes away cancels the pipeline's stream, which cancels the engine call; usage
records what was generated up to then, as on gRPC.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Awaitable, Callable

import structlog
import uvicorn
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.gateway import metrics
from services.gateway.auth import Caller, authenticate
from services.gateway.inference import Chunk, Pipeline
from services.gateway.openai_format import (DONE, Reply, chat_logprobs, completion_logprobs,
                                            error_body, merge_completion_logprobs, models_list,
                                            service_error, sse)
from services.gateway.openai_schema import (ChatCompletionRequest, CompletionRequest,
                                            chat_request, completion_request, openapi_document)
from services.gateway.validation import SESSION_HEADER, InferenceRequest, validate
from tokenserve.runtime.errors import ServiceError
from tokenserve.runtime.tls import PLAINTEXT, TlsConfig

log = structlog.get_logger(component="http")

Send = Callable[[dict], Awaitable[None]]
_JSON = [(b"content-type", b"application/json")]
# pydantic names the branch of a union it tried (`str`, `list[TextPart]`) in an error's loc.
_UNION_BRANCHES = frozenset({"str", "int", "float", "bool", "none"})
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no")]


def _json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(body, status_code=status, headers=headers)


def _error_response(err: ServiceError, fields=()) -> Response:
    status, headers, body = service_error(err, fields)
    return _json_response(status, body, headers)


def _bad_body(err: ValidationError) -> Response:
    first = err.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return _json_response(400, error_body(
            f"the request body is not valid JSON: {first['msg']}", "invalid_request_error"))
    loc = ""
    for part in first["loc"]:
        if isinstance(part, int):
            loc += f"[{part}]"
        elif part not in _UNION_BRANCHES and "[" not in part and "-" not in part:
            loc += f".{part}" if loc else part
    return _json_response(400, error_body(f"{loc or 'body'}: {first['msg']}",
                                          "invalid_request_error", param=loc or None))


class _WatchDisconnect(Response):
    """An ASGI response whose producer is cancelled as soon as the client goes away;
    `finish` runs however it ends (even when cancelled before it started)."""

    def __init__(self, produce: Callable[[Send], Awaitable[None]],
                 finish: Callable[[], Awaitable[None]]):
        self._produce, self._finish = produce, finish

    async def __call__(self, scope, receive, send) -> None:
        async def gone():
            while (await receive())["type"] != "http.disconnect":
                pass

        task = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(gone())
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            task.cancel()  # no-op when it finished
            try:
                await task
            except asyncio.CancelledError:
                pass
            finally:
                await self._finish()


class _Call:
    """One generation request: the caller, its request and the pipeline stream it reads."""

    def __init__(self, method: str, caller: Caller, req: InferenceRequest, reply: Reply,
                 stream: AsyncIterator[Chunk], started: float, fields):
        self.method, self.caller, self.req, self.reply = method, caller, req, reply
        self.stream, self.started = stream, started
        self.headers = [(b"x-request-id", req.request_id.encode())]
        # The request body's field names (an error's `param` is one of them).
        self.fields = fields
        # The final status; stays CANCELLED unless the stream ends some other way.
        self.code = "CANCELLED"

    async def close(self) -> None:
        """Closes the pipeline's stream (cancelling the engine call if it still runs) and
        counts the request."""
        await self.stream.aclose()
        metrics.REQUESTS.labels(self.method, self.caller.tier, self.code).inc()
        metrics.REQUEST_SECONDS.labels(self.method).observe(time.monotonic() - self.started)


class HttpFront:
    def __init__(self, pipeline: Pipeline, default_timeout: float, *, host: str, port: int,
                 grace_seconds: float = 5.0, max_body_bytes: int = 16 * 1024 * 1024,
                 tls: TlsConfig = PLAINTEXT):
        self._pipeline = pipeline
        self._tls = tls  # HTTPS with the gRPC port's certificate when it serves TLS
        self._max_body = max_body_bytes
        self._default_timeout = default_timeout
        self._host, self._port, self._grace = host, port, grace_seconds
        self._openapi = openapi_document("tokenserve OpenAI-compatible API", "1")
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], exception_handlers={HTTPException: self._http_error, Exception: self._crash})
        self._server: uvicorn.Server | None = None
        self.port: int | None = None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> int:
        """Binds (OSError when the port is taken) and serves in the running loop."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # proto=IPPROTO_TCP: asyncio turns Nagle off only on sockets that name it, and with
        # Nagle on, each SSE event after the first waits for the client's delayed ACK (40 ms).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError:
            sock.close()
            raise
        sock.listen(1024)
        sock.setblocking(False)
        config = uvicorn.Config(self.app, lifespan="off", access_log=False, log_config=None,
                                log_level="warning", server_header=False, date_header=False,
                                timeout_graceful_shutdown=self._grace,
                                **self._tls.uvicorn_kwargs())
        config.load()
        server = uvicorn.Server(config)
        # What Server.serve does before startup, without its signal handlers and tick loop:
        # the gateway's loop owns signals and shutdown.
        server.lifespan = config.lifespan_class(config)
        self._server, self._sock = server, sock
        await server.startup(sockets=[sock])
        self.port = sock.getsockname()[1]
        log.info("http_serving", port=self.port)
        return self.port

    async def stop(self) -> None:
        """Stops accepting, lets running requests finish for the grace period, then cancels."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.should_exit = True
        await server.shutdown(sockets=[self._sock])

    # -- endpoints -------------------------------------------------------------------------
    def _caller(self, request: Request) -> Caller:
        value = request.headers.get("authorization")
        return authenticate(self._pipeline.snapshot,
                            () if value is None else (("authorization", value),))

    async def health(self, request: Request) -> Response:
        return _json_response(200, {"status": "ok"})

    async def openapi(self, request: Request) -> Response:
        return _json_response(200, self._openapi)

    async def models(self, request: Request) -> Response:
        tier, code = "none", "OK"
        try:
            tier = self._caller(request).tier
            return _json_response(200, models_list(
                self._pipeline.router.models(self._pipeline.snapshot)))
        except ServiceError as e:
            code = e.code.name
            return _error_response(e)
        finally:
            metrics.REQUESTS.labels("HttpModels", tier, code).inc()

    async def chat_completions(self, request: Request) -> Response:
        return await self._generation(request, "HttpChatCompletions", ChatCompletionRequest,
                                      chat_request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generation(request, "HttpCompletions", CompletionRequest,
                                      completion_request, chat=False)

    async def _generation(self, request: Request, method: str, model: type[BaseModel],
                          convert, *, chat: bool) -> Response:
        started, tier = time.monotonic(), "none"
        try:
            caller = self._caller(request)
            tier = caller.tier
            raw = await _read_body(request, self._max_body)
            if raw is None:
                metrics.REQUESTS.labels(method, tier, "INVALID_ARGUMENT").inc()
                return _json_response(413, error_body(
                    f"the request body is over {self._max_body} bytes", "invalid_request_error"))
            try:
                body = model.model_validate_json(raw)
            except ValidationError as e:
                metrics.REQUESTS.labels(method, tier, "INVALID_ARGUMENT").inc()
                return _bad_body(e)
            req = replace(convert(body, default_max_tokens=caller.max_tokens,
                                  request_id=request.headers.get("x-request-id", "")),
                          session_id=request.headers.get(SESSION_HEADER, ""))
            req = validate(req, tier_cap=caller.max_tokens, tier=caller.tier)
            name = self._pipeline.router.resolve_model(self._pipeline.snapshot, req.model)
        except ServiceError as e:
            metrics.REQUESTS.labels(method, tier, e.code.name).inc()
            return _error_response(e, model.model_fields)
        reply = Reply(("chatcmpl-" if chat else "cmpl-") + req.request_id, int(time.time()),
                      name, chat)
        call = _Call(method, caller, req, reply,
                     self._pipeline.stream(caller, req, self._default_timeout), started,
                     model.model_fields)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _WatchDisconnect(lambda send: self._events(call, send, include_usage),
                                    call.close)
        return _WatchDisconnect(lambda send: self._whole(call, send), call.close)

    async def _first(self, call: _Call, send: Send) -> Chunk | None:
        """The first chunk, or None after answering the refusal (limits, no engine, unknown
        model, deadline) with its own HTTP status."""
        try:
            first = await anext(call.stream)
        except ServiceError as e:
            call.code = e.code.name
            status, extra, body = service_error(e, call.fields)
            await _send_json(send, status, body, call.headers + _encode(extra))
            return None
        # what is left of the tenant's limits (as OpenAI sends it), the degradation level
        call.headers += [(k.encode(), v.encode()) for k, v in first.metadata]
        return first

    async def _rest(self, call: _Call, first: Chunk) -> AsyncIterator[Chunk]:
        yield first
        try:
            async for chunk in call.stream:
                yield chunk
        except ServiceError as e:
            call.code = e.code.name
            raise
        call.code = "OK"

    async def _logprobs(self, call: _Call, chunk: Chunk, offset: int):
        if not call.req.logprobs or not chunk.logprobs:
            return None
        ids = {lp.token_id for lp in chunk.logprobs} | {
            i for lp in chunk.logprobs for i, _ in lp.top}
        texts = await self._pipeline.tokenizer.token_texts(call.reply.model, sorted(ids),
                                                           self._default_timeout)
        if call.reply.chat:
            return chat_logprobs(chunk, texts)
        return completion_logprobs(chunk, texts, offset)

    async def _events(self, call: _Call, send: Send, include_usage: bool) -> None:
        first = await self._first(call, send)
        if first is None:
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": _SSE + call.headers})
        offset, last, reply = 0, None, call.reply
        try:
            async for chunk in self._rest(call, first):
                lp = await self._logprobs(call, chunk, offset) if call.req.logprobs else None
                offset += len(chunk.text)
                if last is None or lp is not None or chunk.finish_reason:
                    event = sse(reply.chunk(chunk, first=last is None, logprobs=lp,
                                            with_usage_field=include_usage))
                else:  # the common case, once per token
                    event = reply.text_event(chunk.text, with_usage_field=include_usage)
                await send({"type": "http.response.body", "body": event, "more_body": True})
                last = chunk
        except ServiceError as e:
            # The status line is sent: the error travels as an event (OpenAI's SDKs raise it).
            _, _, body = service_error(e, call.fields)
            await send({"type": "http.response.body", "body": sse(body), "more_body": True})
        else:
            if include_usage and last is not None:
                await send({"type": "http.response.body",
                            "body": sse(call.reply.usage_chunk(last)), "more_body": True})
        await send({"type": "http.response.body", "body": DONE, "more_body": False})

    async def _whole(self, call: _Call, send: Send) -> None:
        first = await self._first(call, send)
        if first is None:
            return
        texts: list[str] = []
        parts: list[dict] = []
        offset, last = 0, first
        try:
            async for chunk in self._rest(call, first):
                lp = await self._logprobs(call, chunk, offset)
                if lp is not None:
                    parts.append(lp)
                texts.append(chunk.text)
                offset += len(chunk.text)
                last = chunk
        except ServiceError as e:
            status, extra, body = service_error(e, call.fields)
            await _send_json(send, status, body, call.headers + _encode(extra))
            return
        logprobs = None
        if parts:
            logprobs = ({"content": [c for p in parts for c in p["content"]]}
                        if call.reply.chat else merge_completion_logprobs(parts))
        await _send_json(send, 200, call.reply.whole("".join(texts), last, logprobs),
                         call.headers)

    # -- framework errors ----------------------------------------------------------------
    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _json_response(exc.status_code, error_body(
            f"{request.method} {request.url.path}: {exc.detail}", kind))

    async def _crash(self, request: Request, exc: Exception) -> Response:
        # Type only: the exception text may quote request content.
        log.error("http_unhandled_exception", path=request.url.path, exc_type=type(exc).__name__)
        return _json_response(500, error_body("internal error", "server_error"))


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None when it is longer than `limit` bytes. An oversize body is read to
    its end and dropped (up to 4x the limit) before the 413 goes out: a client that sends
    its whole body before reading the answer (urllib, httpx) would otherwise see the
    connection reset instead of the 413."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > 4 * limit:
        return None
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > 4 * limit:
            return None
        if size <= limit:
            parts.append(part)
    return b"".join(parts) if size <= limit else None


def _encode(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode()) for k, v in headers.items()]


async def _send_json(send: Send, status: int, body: Any, headers) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": _JSON + [(b"content-length", str(len(data)).encode())] + headers})
    await send({"type": "http.response.body", "body": data})

