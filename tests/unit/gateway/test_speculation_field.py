"""The per-request `speculation` switch travels from the public protos to the engine's."""
from __future__ import annotations

import pytest

from services.gateway.downstream import engine_request
from services.gateway.servicer import request_from_pb
from tokenserve.common.v1 import common_pb2
from tokenserve.gateway.v1 import gateway_pb2


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("value", [None, False, True])
def test_speculation_reaches_the_engine_request(chat, value):
    fields = {} if value is None else {"speculation": value}
    if chat:
        pb = gateway_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content="hi")],
                                     max_tokens=4, **fields)
    else:
        pb = gateway_pb2.GenerateRequest(prompt="hi", max_tokens=4, **fields)
    req = request_from_pb(pb, chat=chat)
    assert req.speculation is value
    out = engine_request(req, [1, 2], priority=0, tenant_id="t")
    assert out.HasField("speculation") is (value is not None)
    assert out.speculation is bool(value)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("value", [None, False, True])
def test_the_openai_bodies_extension_reaches_the_engine_request(chat, value):
    from services.gateway.openai_schema import (ChatCompletionRequest, CompletionRequest,
                                                chat_request, completion_request)

    body = {} if value is None else {"speculation": value}
    if chat:
        req = chat_request(ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], **body}),
            default_max_tokens=4, request_id="r")
    else:
        req = completion_request(CompletionRequest.model_validate({"prompt": "hi", **body}),
                                 default_max_tokens=4, request_id="r")
    assert req.speculation is value
    out = engine_request(req, [1, 2], priority=0, tenant_id="t")
    assert out.HasField("speculation") is (value is not None)
    assert out.speculation is bool(value)


def test_the_openapi_document_describes_the_extension():
    from services.gateway.openai_schema import openapi_document

    schemas = openapi_document("t", "1")["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        prop = schemas[name]["properties"]["speculation"]
        assert {"type": "boolean"} in prop["anyOf"] and "speculative decoding" in prop["description"]
