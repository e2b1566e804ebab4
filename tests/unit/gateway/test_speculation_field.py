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
