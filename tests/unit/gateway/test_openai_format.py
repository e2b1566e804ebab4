"""The HTTP front's error mapping: statuses, OpenAI's error shape, rate-limit headers."""
from __future__ import annotations

import pytest

from services.gateway.openai_format import param_of, ratelimit_headers, service_error
from services.gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from tokenserve.runtime.errors import (Conflict, DeadlineExceeded, InvalidArgument, NotFound,
                                       PermissionDenied, ResourceExhausted, ServiceError,
                                       Unauthenticated, Unavailable)

CHAT = ChatCompletionRequest.model_fields


@pytest.mark.parametrize("err, status, kind", [
    (InvalidArgument("x"), 400, "invalid_request_error"),
    (Unauthenticated("x"), 401, "authentication_error"),
    (PermissionDenied("x"), 403, "permission_error"),
    (NotFound("x"), 404, "not_found_error"),
    (Conflict("x"), 409, "conflict_error"),
    (ResourceExhausted("x"), 429, "rate_limit_error"),
    (Unavailable("x"), 503, "service_unavailable"),
    (DeadlineExceeded("x"), 504, "timeout_error"),
    (ServiceError("x"), 500, "server_error"),
])
def test_each_status_maps_to_its_http_status_and_type(err, status, kind):
    got, _, body = service_error(err)
    assert got == status
    assert body == {"error": {"message": "x", "type": kind, "param": None,
                              "code": err.code.name.lower()}}


def test_a_limit_gets_retry_after_rounded_up_and_ratelimit_headers():
    err = ResourceExhausted("tier free allows 10 requests/s", retry_after=1.2)
    err.metadata += (("limit", "rps"), ("limit-remaining", "0"))
    status, headers, body = service_error(err)
    assert status == 429
    assert headers == {"retry-after": "2", "retry-after-ms": "1200", "x-ratelimit-limit": "rps",
                       "x-ratelimit-remaining": "0"}
    assert body["error"]["code"] == "rps"


def test_unreadable_retry_after_is_left_out():
    assert ratelimit_headers((("retry-after-ms", "soon"),)) == {}


@pytest.mark.parametrize("message, fields, param", [
    ("max_tokens is 40; the free tier allows at most 16", CHAT, "max_tokens"),
    ("messages[0].role must be one of system, user, assistant", CHAT, "messages[0].role"),
    ("app is 70 characters; at most 64", CHAT, "user"),
    ("prompt is 63 tokens and max_tokens is 10", CHAT, None),
    ("prompt is 63 tokens and max_tokens is 10", CompletionRequest.model_fields, "prompt"),
    ("deadline of 3s passed", CHAT, None),
    ("stop[1] must be 1-256 characters, got 0", CHAT, "stop[1]"),
    ("messages: every content is empty", CHAT, "messages"),
    ("messages[1].content contains a NUL character at offset 0", CHAT, "messages[1].content"),
])
def test_param_names_the_public_field(message, fields, param):
    assert param_of(message, fields) == param


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("with_usage_field", [True, False])
def test_the_prebuilt_text_event_is_the_chunk_serialized(chat, with_usage_field):
    from services.gateway.inference import Chunk
    from services.gateway.openai_format import Reply, sse

    reply = Reply("chatcmpl-r", 1700000000, "m", chat)
    for text in (" Paris", 'quote " backslash \\ newline \n é 中', ""):
        chunk = Chunk(text=text, token_ids=[1], request_id="")
        assert reply.text_event(text, with_usage_field=with_usage_field) == sse(
            reply.chunk(chunk, first=False, logprobs=None, with_usage_field=with_usage_field))
