"""One table of bad input to the public API: each case is sent to the gateway over gRPC and
over the OpenAI-compatible HTTP API, with the status and message words each must answer.

Most cases need no model and run against the gateway with fake model services
(tests/integration/gateway/test_bad_input.py: tier `free`, max_tokens <= 16, model `tiny` with
a context of 64); the cases marked `needs="suite"` need the real engine (its GetInfo shows the
KV blocks freed) and run in tests/e2e/test_tokenserve_up.py. A case's `scenario` says how it is
driven: `call` (one request, one answer), `deadline` (a 0.5 s deadline on a long generation),
`cancel` (the client leaves after the first token), `reuse` (a second request with the id of
one still running).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import Message

from tokenserve.common.v1 import common_pb2
from tokenserve.gateway.v1 import gateway_pb2 as pb

SERVICE = "tokenserve.gateway.v1.InferenceService"
STREAMING = {"Generate", "Chat"}
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
LONG_COUNT = "Count from 1 to 1000: 1, 2, 3, 4, 5,"  # the model goes on for hundreds of tokens


@dataclass(frozen=True)
class Http:
    method: str
    path: str  # under the gateway's /v1
    body: dict | bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def data(self) -> bytes | None:
        if self.body is None or isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode()  # NaN and Infinity as JavaScript writes them


@dataclass(frozen=True)
class Request:
    """The same request for both APIs."""

    rpc: str
    grpc: Message | bytes  # bytes go on the wire as they are
    http: Http


@dataclass(frozen=True)
class Case:
    id: str
    request: Request
    code: str                     # gRPC status name
    words: tuple[str, ...]        # each in the status details
    http_status: int | None       # None: the client left, there is no status to see
    http_type: str | None = None  # the OpenAI error body's `type`
    http_param: str | None = None
    http_words: tuple[str, ...] | None = None  # default: `words`
    key: str = "tenant"           # which authorization the call carries (see AUTH)
    scenario: str = "call"
    needs: str = "fakes"

    @property
    def expected_http_words(self) -> tuple[str, ...]:
        return self.words if self.http_words is None else self.http_words


# -- requests ------------------------------------------------------------------------------

_HTTP_SAMPLING = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")


def _http_common(f: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    body: dict[str, Any] = {k: f[k] for k in ("model", "max_tokens", "stop", *_HTTP_SAMPLING)
                            if k in f}
    if "app" in f:
        body["user"] = f["app"]
    sampling = f.get("sampling") or {}
    body.update({k: v for k, v in sampling.items() if k in _HTTP_SAMPLING})
    headers = {"x-request-id": f["request_id"]} if "request_id" in f else {}
    return body, headers


def _pb_common(f: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in f.items() if k not in ("sampling",)}
    if "sampling" in f:
        out["sampling"] = common_pb2.SamplingParams(**f["sampling"])
    return out


def gen(prompt: str = "hi", **f) -> Request:
    """Generate over gRPC, /v1/completions over HTTP (top_k and sampling fields that
    OpenAI's API lacks are not sent there)."""
    f.setdefault("max_tokens", 2)
    body, headers = _http_common(f)
    return Request("Generate", pb.GenerateRequest(prompt=prompt, **_pb_common(f)),
                   Http("POST", "/completions", {"prompt": prompt, **body}, headers))


def chat(*turns: tuple[str, str], **f) -> Request:
    """Chat over gRPC, /v1/chat/completions over HTTP."""
    f.setdefault("max_tokens", 2)
    body, headers = _http_common(f)
    if f.get("logprobs"):
        body["logprobs"] = True
    if "top_logprobs" in f:
        body["top_logprobs"] = f["top_logprobs"]
    messages = [common_pb2.ChatMessage(role=r, content=c) for r, c in turns]
    return Request("Chat", pb.ChatRequest(messages=messages, **_pb_common(f)),
                   Http("POST", "/chat/completions",
                        {"messages": [{"role": r, "content": c} for r, c in turns], **body},
                        headers))


def raw(rpc: str, message: Message, http: Http, bad: bytes = b"\xff\xfe") -> Request:
    """`message` serialized, with every b"XX" replaced by `bad` (invalid UTF-8 in a string
    field: no client library would send it, but anything can)."""
    return Request(rpc, message.SerializeToString().replace(b"XX", bad), http)


def _raw_json(body: dict, bad: bytes = b"\xff\xfe") -> bytes:
    return json.dumps(body).encode().replace(b"XX", bad)


def usage(**f) -> Request:
    return Request("GetUsage", pb.GetUsageRequest(**f), Http("GET", "/usage?tenant_id=vip"))


def count(prompt: str) -> Request:
    return Request("CountTokens", pb.CountTokensRequest(prompt=prompt),
                   Http("POST", "/count_tokens", {"prompt": prompt}))


INVALID, BAD_REQUEST = "INVALID_ARGUMENT", "invalid_request_error"
NOT_JSON = ("the request body is not valid JSON",)

CASES: list[Case] = [
    # prompts
    Case("empty prompt", gen(""), INVALID, ("prompt must not be empty",), 400, BAD_REQUEST,
         "prompt"),
    Case("oversize prompt", gen("x" * 1_000_001), INVALID,
         ("prompt is 1000001 characters; at most 1000000",), 400, BAD_REQUEST, "prompt"),
    Case("prompt beyond the context", gen(" ".join(["w"] * 60), max_tokens=10), INVALID,
         ("prompt is 60 tokens", "context of 64 tokens"), 400, BAD_REQUEST, "prompt"),
    Case("NUL byte in the prompt", gen("ab\x00cd"), INVALID,
         ("prompt contains a NUL character at offset 2",), 400, BAD_REQUEST, "prompt"),
    Case("request over the message size limit", gen("x" * (MAX_MESSAGE_BYTES + 10)),
         "RESOURCE_EXHAUSTED", ("larger than max",), 413, BAD_REQUEST,
         http_words=(f"over {MAX_MESSAGE_BYTES} bytes",)),
    # max_tokens
    Case("max_tokens 0", gen(max_tokens=0), INVALID, ("max_tokens must be >= 1, got 0",), 400,
         BAD_REQUEST, "max_tokens"),
    Case("max_tokens -1", gen(max_tokens=-1), INVALID, ("max_tokens must be >= 1, got -1",),
         400, BAD_REQUEST, "max_tokens"),
    Case("max_tokens huge", gen(max_tokens=2**31 - 1), INVALID,
         ("max_tokens is 2147483647; the free tier allows at most 16",), 400, BAD_REQUEST,
         "max_tokens"),
    # sampling
    Case("temperature NaN", gen(temperature=float("nan")), INVALID,
         ("temperature must be a finite number, got nan",), 400, BAD_REQUEST, "temperature"),
    Case("temperature inf", gen(temperature=float("inf")), INVALID,
         ("temperature must be a finite number, got inf",), 400, BAD_REQUEST, "temperature"),
    Case("temperature -1", gen(temperature=-1), INVALID,
         ("temperature must be >= 0 (0 is greedy), got -1",), 400, BAD_REQUEST, "temperature"),
    Case("top_p 0", gen(top_p=0), INVALID, ("top_p must be in (0, 1], got 0",), 400,
         BAD_REQUEST, "top_p"),
    Case("top_p 1.5", gen(top_p=1.5), INVALID, ("top_p must be in (0, 1], got 1.5",), 400,
         BAD_REQUEST, "top_p"),
    # OpenAI's API has no top_k: the HTTP body does not carry it, and the request is served
    Case("top_k -1", gen(top_k=-1), INVALID, ("top_k must be >= 0 (0 disables it), got -1",),
         200),
    Case("presence_penalty 3", gen(sampling={"presence_penalty": 3}), INVALID,
         ("presence_penalty must be in [-2, 2], got 3",), 400, BAD_REQUEST, "presence_penalty"),
    Case("frequency_penalty -inf", gen(sampling={"frequency_penalty": float("-inf")}), INVALID,
         ("frequency_penalty must be a finite number, got -inf",), 400, BAD_REQUEST,
         "frequency_penalty"),
    Case("top_logprobs 21", chat(("user", "hi"), logprobs=True, top_logprobs=21), INVALID,
         ("top_logprobs must be in 0..20, got 21",), 400, BAD_REQUEST, "top_logprobs"),
    # stop strings
    Case("10,000 stop strings", gen(stop=["s"] * 10_000), INVALID,
         ("stop holds 10000 strings; at most 16",), 400, BAD_REQUEST, "stop"),
    Case("one 100 KB stop string", gen(stop=["s" * 102_400]), INVALID,
         ("stop[0] must be 1-256 characters, got 102400",), 400, BAD_REQUEST, "stop[0]"),
    Case("empty stop string", gen(stop=["ok", ""]), INVALID,
         ("stop[1] must be 1-256 characters, got 0",), 400, BAD_REQUEST, "stop[1]"),
    Case("NUL byte in a stop string", gen(stop=["a\x00"]), INVALID,
         ("stop[0] contains a NUL character at offset 1",), 400, BAD_REQUEST, "stop[0]"),
    # models
    Case("unknown model", gen(model="gpt-9"), "NOT_FOUND",
         ("'gpt-9' is not served here", "tiny"), 404, "not_found_error"),
    Case("model with no engine", gen(model="lonely"), "UNAVAILABLE",
         ("no engine is serving model 'lonely'",), 503, "service_unavailable"),
    # chat
    Case("chat with no messages", chat(), INVALID, ("messages must hold at least one message",),
         400, BAD_REQUEST, "messages"),
    Case("chat with an unknown role", chat(("robot", "x")), INVALID,
         ("messages[0].role must be one of system, user, assistant, got 'robot'",), 400,
         BAD_REQUEST, "messages[0].role", http_words=("messages[0].role",)),
    Case("chat with only empty contents", chat(("user", ""), ("assistant", "")), INVALID,
         ("messages: every content is empty",), 400, BAD_REQUEST, "messages"),
    Case("NUL byte in a message", chat(("user", "fine"), ("user", "\x00")), INVALID,
         ("messages[1].content contains a NUL character at offset 0",), 400, BAD_REQUEST,
         "messages[1].content"),
    Case("1001 messages", chat(*[("user", "m")] * 1001), INVALID,
         ("messages holds 1001; at most 1000",), 400, BAD_REQUEST, "messages"),
    Case("chat beyond the context", chat(("user", " ".join(["w"] * 60)), max_tokens=10),
         INVALID, ("context of 64 tokens",), 400, BAD_REQUEST),
    # labels
    Case("oversize request_id", gen(request_id="r" * 129), INVALID,
         ("request_id must be 1-128 characters",), 400, BAD_REQUEST),
    Case("request_id with spaces", gen(request_id="my id"), INVALID,
         ("request_id must be 1-128 characters of letters, digits",), 400, BAD_REQUEST),
    Case("oversize app label", gen(app="a" * 65), INVALID, ("app is 65 characters; at most 64",),
         400, BAD_REQUEST, "user"),
    Case("NUL byte in the app label", gen(app="bot\x00"), INVALID,
         ("app contains a NUL character at offset 3",), 400, BAD_REQUEST, "user"),
    # keys
    Case("no key", gen(), "UNAUTHENTICATED", ("missing authorization metadata",), 401,
         "authentication_error", key="none"),
    Case("forged key", gen(), "UNAUTHENTICATED", ("invalid or revoked API key",), 401,
         "authentication_error", key="forged"),
    Case("empty bearer token", gen(), "UNAUTHENTICATED",
         ("authorization metadata must be 'Bearer ts-...'",), 401, "authentication_error",
         key="empty"),
    Case("Basic credentials", gen(), "UNAUTHENTICATED",
         ("authorization metadata must be 'Bearer ts-...'",), 401, "authentication_error",
         key="basic"),
    Case("an OpenAI key", gen(), "UNAUTHENTICATED", ("invalid or revoked API key",), 401,
         "authentication_error", key="openai"),
    Case("revoked key", gen(), "UNAUTHENTICATED", ("invalid or revoked API key",), 401,
         "authentication_error", key="revoked"),
    Case("key of a disabled tenant", gen(), "PERMISSION_DENIED", ("tenant 'off' is disabled",),
         403, "permission_error", key="disabled"),
    # usage and token counts exist only on gRPC: over HTTP there is no such endpoint at all
    Case("another tenant's usage", usage(tenant_id="vip"), "PERMISSION_DENIED",
         ("'vip'",), 404, "not_found_error", http_words=("Not Found",)),
    Case("count tokens of nothing", count(""), INVALID, ("prompt must not be empty",), 404,
         "not_found_error", http_words=("Not Found",)),
    # bytes that are not what the schema says
    Case("invalid UTF-8 in the prompt",
         raw("Generate", pb.GenerateRequest(prompt="aXXc", max_tokens=2),
             Http("POST", "/completions", _raw_json({"prompt": "aXXc", "max_tokens": 2}))),
         INVALID, ("prompt is not valid UTF-8 (bad byte at offset 1",), 400, BAD_REQUEST,
         http_words=NOT_JSON),
    Case("invalid UTF-8 in a message",
         raw("Chat", pb.ChatRequest(max_tokens=2, messages=[
             common_pb2.ChatMessage(role="user", content="ok"),
             common_pb2.ChatMessage(role="user", content="aXXc")]),
             Http("POST", "/chat/completions", _raw_json({"max_tokens": 2, "messages": [
                 {"role": "user", "content": "ok"}, {"role": "user", "content": "aXXc"}]}))),
         INVALID, ("messages[1].content is not valid UTF-8",), 400, BAD_REQUEST,
         http_words=NOT_JSON),
    Case("invalid UTF-8 in a stop string",
         raw("Generate", pb.GenerateRequest(prompt="hi", max_tokens=2, stop=["ok", "XX"]),
             Http("POST", "/completions", _raw_json({"prompt": "hi", "stop": ["ok", "XX"]}))),
         INVALID, ("stop[1] is not valid UTF-8",), 400, BAD_REQUEST, http_words=NOT_JSON),
    Case("a UTF-8-encoded lone surrogate",
         raw("Generate", pb.GenerateRequest(prompt="aXXc", max_tokens=2),
             Http("POST", "/completions", b'{"prompt": "a\\ud800c"}'), bad=b"\xed\xa0\x80"),
         INVALID, ("prompt is not valid UTF-8 (bad byte at offset 1",), 400, BAD_REQUEST,
         http_words=NOT_JSON),
    Case("invalid UTF-8 to count tokens",
         raw("CountTokens", pb.CountTokensRequest(chat=pb.ChatMessages(messages=[
             common_pb2.ChatMessage(role="user", content="XX")])),
             Http("POST", "/completions", _raw_json({"prompt": "XX"}))),
         INVALID, ("chat.messages[0].content is not valid UTF-8",), 400, BAD_REQUEST,
         http_words=NOT_JSON),
    Case("bytes that are no message at all",
         Request("Generate", b"\xff\xff\xff", Http("POST", "/completions", b"\xff\xff\xff")),
         INVALID, ("not a valid tokenserve.gateway.v1.GenerateRequest",), 400, BAD_REQUEST,
         http_words=NOT_JSON),
    Case("a method that does not exist",
         Request("Nope", b"", Http("POST", "/nope", {})), "UNIMPLEMENTED", ("Method not found",),
         404, "not_found_error", http_words=("Not Found",)),
    # behaviour over time
    Case("a second request with the id of one still running",
         gen(max_tokens=16, request_id="reused-1"), "ALREADY_EXISTS",
         ("request_id 'reused-1' is already in flight",), 409, "conflict_error",
         scenario="reuse"),
    Case("a 0.5 s deadline on a long generation", gen(LONG_COUNT, max_tokens=2000),
         "DEADLINE_EXCEEDED", ("deadline",), None, scenario="deadline", needs="suite"),
    Case("a client cancel after one token", gen(LONG_COUNT, max_tokens=2000), "CANCELLED",
         ("Locally cancelled",), None, scenario="cancel", needs="suite"),
]


def cases(needs: str) -> list[Case]:
    return [c for c in CASES if c.needs == needs]


def ids(table: list[Case]) -> list[str]:
    return [c.id.replace(" ", "_") for c in table]


# -- sending -------------------------------------------------------------------------------

def grpc_call(channel: grpc.Channel, req: Request, authorization: str | None,
              timeout: float = 30.0):
    """The call object (a stream for Generate/Chat) of `req`, bytes on the wire."""
    path = f"/{SERVICE}/{req.rpc}"
    data = req.grpc if isinstance(req.grpc, bytes) else req.grpc.SerializeToString()
    md = () if authorization is None else (("authorization", authorization),)
    if req.rpc in STREAMING:
        return channel.unary_stream(path)(data, metadata=md, timeout=timeout)
    return channel.unary_unary(path).future(data, metadata=md, timeout=timeout)


def grpc_outcome(channel: grpc.Channel, req: Request, authorization: str | None,
                 timeout: float = 30.0) -> tuple[str, str]:
    """(status name, details) of sending `req`; ("OK", "") when it succeeds."""
    call = grpc_call(channel, req, authorization, timeout)
    try:
        if req.rpc in STREAMING:
            list(call)
        else:
            call.result()
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""
    return "OK", ""


def http_outcome(base_url: str, req: Request, authorization: str | None,
                 timeout: float = 30.0) -> tuple[int, dict]:
    """(HTTP status, the `error` object of the body, or {} on success)."""
    h = req.http
    headers = {"content-type": "application/json", **h.headers}
    if authorization is not None:
        headers["authorization"] = authorization
    r = urllib.request.Request(base_url + h.path, data=h.data(), headers=headers,
                               method=h.method)
    try:
        with urllib.request.urlopen(r, timeout=timeout) as resp:
            resp.read()
            return resp.status, {}
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body).get("error") or {}
        except ValueError:
            return e.code, {"message": body.decode(errors="replace")}
