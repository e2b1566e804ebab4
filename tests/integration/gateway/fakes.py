"""In-process FAKE tokenizer and engine gRPC servers, for gateway logic that needs no model
(auth, validation, routing, retries, cancellation, usage spooling). They speak the real
protos; the text they produce is meaningless. Tests of real generation use the real services.

Fake tokenizer: one token per whitespace-separated word; a chat costs its words plus 2 per
message plus 1 for the generation prompt. Fake engine: emits max_tokens tokens ("w0 w1 ..."),
`delay` seconds apart; a call that ends before its last token without the fake ending it
(cancelled, or its deadline passed) is recorded in `cancelled` and sets `cancel_seen`, through
gRPC's termination callback: a sync server stops iterating a handler whose send failed, so a
check between tokens alone misses a deadline that strikes just after one (with
`expire_within` set, it ends a request itself that close to the caller's deadline, as the real
engine does); `fail_with` refuses every
call, or with `fail_every=n` every n-th one. Given `load` (a LoadReport), it streams that report
from WatchLoad every 0.2 s (change `servicer.load` to report another load); without, WatchLoad
is UNIMPLEMENTED, as on an engine that publishes no load. Every fake server serves
grpc.health.v1 (`set_serving`).
"""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tokenserve.common.v1 import common_pb2
from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tokenserve.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tokenserve.runtime.tls import PLAINTEXT, TlsConfig

MODEL = "tiny"


def fake_token_count(req: tokenizer_pb2.EncodeRequest) -> int:
    if req.WhichOneof("input") == "chat":
        words = sum(len(m.content.split()) + 2 for m in req.chat.messages)
        return words + (1 if req.add_generation_prompt else 0)
    return len(req.text.split())


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(self):
        self.requests: list[tokenizer_pb2.EncodeRequest] = []
        self.delay = 0.0  # seconds each Encode takes

    def Encode(self, request, context):
        if request.model != MODEL:
            context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not loaded")
        self.requests.append(request)
        if self.delay:
            time.sleep(self.delay)
        return tokenizer_pb2.EncodeResponse(token_ids=list(range(fake_token_count(request))))

    def CountTokens(self, request, context):
        if request.model != MODEL:
            context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not loaded")
        return tokenizer_pb2.CountTokensResponse(count=fake_token_count(request))


class FakeEngine(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, version: str = "v1", delay: float = 0.0,
                 fail_with: grpc.StatusCode | None = None, fail_every: int = 0,
                 load: engine_pb2.LoadReport | None = None):
        self.version = version
        self.load = load
        self.delay = delay
        self.fail_with = fail_with
        self.fail_every = fail_every
        # seconds before the caller's deadline at which the engine ends the request itself
        self.expire_within: float | None = None
        self.requests: list[engine_pb2.GenerateRequest] = []
        self._lock = threading.Lock()
        self.cancelled: list[str] = []
        self.cancel_seen = threading.Event()
        # when set to an Event: each request waits for it before its first token
        self.hold: threading.Event | None = None

    def Generate(self, request, context):
        with self._lock:
            self.requests.append(request)
            n = len(self.requests)
        if self.fail_with is not None and (not self.fail_every or n % self.fail_every == 0):
            context.abort(self.fail_with, f"fake engine refuses: {self.fail_with.name}")
        if request.prompt_token_ids and request.prompt_token_ids[0] == -1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[0] must be >= 0")
        if self.hold is not None and not self.hold.wait(30):
            context.abort(grpc.StatusCode.INTERNAL, "fake engine: hold never released")
        ended_itself = threading.Event()

        def on_termination() -> None:
            if not ended_itself.is_set():
                with self._lock:
                    self.cancelled.append(request.request_id)
                self.cancel_seen.set()

        context.add_callback(on_termination)
        for i in range(request.max_tokens):
            if self.delay:
                time.sleep(self.delay)
            left = context.time_remaining()
            if self.expire_within is not None and left is not None and left < self.expire_within:
                # as the real engine does when a request's deadline passes in its queue or
                # batch: it ends the stream itself, finish reason cancelled
                ended_itself.set()
                yield engine_pb2.GenerateResponse(
                    finish_reason=common_pb2.FINISH_REASON_CANCELLED,
                    usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                           completion_tokens=i))
                return
            if not context.is_active():
                return  # on_termination records it
            last = i == request.max_tokens - 1
            resp = engine_pb2.GenerateResponse(token_ids=[1000 + i], text=f"w{i} ")
            if last:
                ended_itself.set()
                resp.finish_reason = common_pb2.FINISH_REASON_LENGTH
                resp.usage.CopyFrom(common_pb2.Usage(
                    prompt_tokens=len(request.prompt_token_ids),
                    completion_tokens=request.max_tokens, cached_tokens=1))
                resp.energy_joules = 0.5
            yield resp
        ended_itself.set()  # max_tokens 0: no tokens, an ordinary end

    def WatchLoad(self, request, context):
        if self.load is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this fake engine reports no load")
        while context.is_active():
            yield self.load
            time.sleep(0.2)

    def GetInfo(self, request, context):
        return engine_pb2.GetInfoResponse(model=MODEL, version=self.version, max_context=64)


class FakeServer:
    """A sync gRPC server on a free loopback port, in its own threads."""

    def __init__(self, servicer, add_fn, tls: TlsConfig = PLAINTEXT):
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        add_fn(servicer, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.set_serving(True)
        self.port = (self.server.add_secure_port("127.0.0.1:0", tls.server_credentials())
                     if tls.serves_tls else self.server.add_insecure_port("127.0.0.1:0"))
        self.servicer = servicer
        self.server.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_serving(self, serving: bool) -> None:
        self.health.set("", health_pb2.HealthCheckResponse.SERVING if serving
                        else health_pb2.HealthCheckResponse.NOT_SERVING)

    def stop(self):
        self.server.stop(0).wait()


def fake_tokenizer(tls: TlsConfig = PLAINTEXT) -> FakeServer:
    return FakeServer(FakeTokenizer(), tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server,
                      tls)


def fake_engine(tls: TlsConfig = PLAINTEXT, **kw) -> FakeServer:
    return FakeServer(FakeEngine(**kw), engine_pb2_grpc.add_EngineServiceServicer_to_server, tls)
