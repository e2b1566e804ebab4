"""Pipeline results and errors in OpenAI's response shapes (plain dicts and SSE lines).

    chat.completion / chat.completion.chunk / text_completion, `usage` with
    `prompt_tokens_details.cached_tokens`, and `{"error": {message, type, param, code}}`.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import grpc

from services.gateway.inference import Chunk
from tokenserve.runtime.errors import (LIMIT, LIMIT_PREFIX, RETRY_AFTER_MS, ServiceError)


# gRPC status -> (HTTP status, OpenAI error type).
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_INTERNAL = (500, "server_error")

# Internal names whose public field is called otherwise.
_PUBLIC = {"app": "user"}
_PARAM_RE = re.compile(r"^([a-z_]+)((?:\[\d+\])?(?:\.[a-z_]+)?)(?=[\s:,;]|$)")


def param_of(message: str, fields) -> str | None:
    """`param` of an error: the message's first word when it names one of `fields` (the
    request body's), with its index and sub-field (`messages[0].role`)."""
    m = _PARAM_RE.match(message)
    if m is None:
        return None
    name = _PUBLIC.get(m.group(1), m.group(1))
    return name + m.group(2) if name in fields else None


def error_body(message: str, kind: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def ratelimit_headers(metadata: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Admission metadata as HTTP headers: retry-after-ms -> `Retry-After` (whole seconds,
    rounded up) and `retry-after-ms`; `limit` -> `x-ratelimit-limit`; `limit-X` ->
    `x-ratelimit-X` (e.g. `x-ratelimit-remaining`); `x-...` keys as they are."""
    headers: dict[str, str] = {}
    for key, value in metadata:
        if key == RETRY_AFTER_MS:
            try:
                ms = max(0, int(float(value)))
            except ValueError:
                continue
            headers["retry-after"] = str(math.ceil(ms / 1000))
            headers["retry-after-ms"] = str(ms)
        elif key == LIMIT:
            headers["x-ratelimit-limit"] = value
        elif key.startswith(LIMIT_PREFIX):
            headers["x-ratelimit-" + key[len(LIMIT_PREFIX):]] = value
        elif key.startswith("x-"):  # already a header (x-degradation-level)
            headers[key] = value
    return headers


def service_error(err: ServiceError,
                  fields=()) -> tuple[int, dict[str, str], dict[str, Any]]:
    """(HTTP status, headers, body) for a pipeline error; `fields`: the request body's."""
    status, kind = STATUS.get(err.code, _INTERNAL)
    headers = ratelimit_headers(err.metadata)
    code = dict(err.metadata).get(LIMIT) or err.code.name.lower()
    param = param_of(err.message, fields) if status == 400 else None
    return status, headers, error_body(err.message, kind, param=param, code=code)


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def usage(last: Chunk) -> dict[str, Any]:
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens}}


def finish_reason(chunk: Chunk) -> str | None:
    return None if chunk.finish_reason is None else chunk.finish_reason.value


# -- logprobs: the engine gives ids; `texts` maps each id to its text ----------------------

def chat_logprobs(chunk: Chunk, texts: dict[int, str]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        t = texts.get(token_id, "")
        return {"token": t, "logprob": logprob, "bytes": list(t.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for lp in chunk.logprobs]}


def completion_logprobs(chunk: Chunk, texts: dict[int, str], offset: int) -> dict[str, Any]:
    tokens = [texts.get(lp.token_id, "") for lp in chunk.logprobs]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in chunk.logprobs],
            "top_logprobs": [{texts.get(i, ""): v for i, v in lp.top}
                             for lp in chunk.logprobs],
            "text_offset": offsets}


def merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: [v for p in parts for v in p[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


# -- whole responses and stream chunks ---------------------------------------------------

@dataclass(frozen=True)
class Reply:
    """What every object of one response repeats."""

    id: str
    created: int
    model: str
    chat: bool
    # (prefix, suffix) of a middle chunk's event, around its JSON-encoded text.
    _middle: tuple[bytes, bytes] | None = field(default=None, compare=False, repr=False)

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, last: Chunk, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason(last)
        out = self._base("chat.completion" if self.chat else "text_completion")
        out.update(system_fingerprint=last.model_version, choices=[choice], usage=usage(last))
        return out

    def chunk(self, chunk: Chunk, *, first: bool, logprobs: dict[str, Any] | None,
              with_usage_field: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": chunk.text} if first
                               else {"content": chunk.text})
        else:
            choice["text"] = chunk.text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason(chunk)
        out = self._base("chat.completion.chunk" if self.chat else "text_completion")
        if chunk.model_version:
            out["system_fingerprint"] = chunk.model_version
        out["choices"] = [choice]
        if with_usage_field:
            out["usage"] = None
        return out

    def text_event(self, text: str, *, with_usage_field: bool) -> bytes:
        """The SSE event of a middle chunk (text only): `chunk(...)` serialized, built from a
        prefix and suffix made once per response (a third of the cost per token)."""
        if self._middle is None:
            marker = "\x00"
            probe = sse(self.chunk(Chunk(text=marker, token_ids=[], request_id=""), first=False,
                                   logprobs=None, with_usage_field=with_usage_field))
            head, _, tail = probe.partition(json.dumps(marker).encode())
            object.__setattr__(self, "_middle", (head, tail))
        head, tail = self._middle
        return head + json.dumps(text).encode() + tail

    def usage_chunk(self, last: Chunk) -> dict[str, Any]:
        out = self._base("chat.completion.chunk" if self.chat else "text_completion")
        out.update(system_fingerprint=last.model_version, choices=[], usage=usage(last))
        return out


def models_list(infos) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": m.name, "object": "model", "created": 0, "owned_by": "tokenserve",
         "max_context": m.max_context, "versions": dict(m.versions)} for m in infos]}
