"""SDK request building and error mapping (pure logic; the SDK against the real gateway is in
tests/integration/gateway/test_sdk.py)."""
from __future__ import annotations

import grpc
import pytest

from tokenserve import client as sdk
from tokenserve.client_errors import error_from_rpc
from tokenserve.common.v1 import common_pb2
from tokenserve.gateway.v1 import gateway_pb2


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, trailing=()):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


def test_options_go_to_the_top_level_or_the_sampling_message():
    req = sdk._generate_request("hi", "m", 7, dict(temperature=0.5, top_k=4, seed=3, min_p=0.1,
                                                   presence_penalty=0.5, stop="END", app="a",
                                                   request_id="r1", top_p=None))
    assert (req.prompt, req.model, req.max_tokens) == ("hi", "m", 7)
    assert req.temperature == 0.5 and req.top_k == 4 and req.seed == 3
    assert not req.HasField("top_p")  # None means "not set"
    assert req.sampling.HasField("min_p") and req.sampling.presence_penalty == 0.5
    assert list(req.stop) == ["END"] and req.app == "a" and req.request_id == "r1"


@pytest.mark.parametrize("build", [
    lambda opts: sdk._generate_request("hi", "", 4, opts),
    lambda opts: sdk._chat_request([("user", "hi")], "", 4, opts)])
def test_speculation_false_turns_drafting_off_for_the_request(build):
    off = build({"speculation": False})
    assert off.HasField("speculation") and off.speculation is False  # sent, not the default
    assert build({"speculation": True}).speculation is True
    assert not build({}).HasField("speculation")  # unset: the engine's setting
    assert not build({"speculation": None}).HasField("speculation")


def test_unknown_options_are_a_type_error_listing_the_allowed_ones():
    with pytest.raises(TypeError, match="temprature.*allowed: temperature"):
        sdk._generate_request("hi", "", 1, {"temprature": 1.0})


def test_messages_accept_dicts_and_pairs():
    req = sdk._chat_request([{"role": "system", "content": "be brief"}, ("user", "hi")], "", 3, {})
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"), ("user", "hi")]


def test_count_tokens_needs_exactly_one_input():
    with pytest.raises(TypeError):
        sdk._count_request(None, None, "")
    with pytest.raises(TypeError):
        sdk._count_request("a", [("user", "b")], "")
    assert sdk._count_request(None, [("user", "b")], "").WhichOneof("input") == "chat"


@pytest.mark.parametrize("code, cls", [
    (grpc.StatusCode.UNAUTHENTICATED, sdk.AuthenticationError),
    (grpc.StatusCode.PERMISSION_DENIED, sdk.PermissionDeniedError),
    (grpc.StatusCode.INVALID_ARGUMENT, sdk.InvalidRequestError),
    (grpc.StatusCode.NOT_FOUND, sdk.NotFoundError),
    (grpc.StatusCode.UNAVAILABLE, sdk.UnavailableError),
    (grpc.StatusCode.DEADLINE_EXCEEDED, sdk.DeadlineExceededError),
    (grpc.StatusCode.ABORTED, sdk.TokenserveError),
])
def test_status_codes_become_readable_exceptions(code, cls):
    err = error_from_rpc(FakeRpcError(code, "max_tokens must be >= 1"))
    assert type(err) is cls
    assert err.code == code and err.message == "max_tokens must be >= 1"
    assert str(err) == f"{code.name}: max_tokens must be >= 1"


def test_rate_limits_carry_retry_after_seconds_and_the_limit():
    err = error_from_rpc(FakeRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down",
        (("retry-after-ms", "1500"), ("limit", "tpm"), ("limit-remaining", "12"))))
    assert isinstance(err, sdk.RateLimitError) and err.retry_after == 1.5
    assert (err.limit, err.remaining) == ("tpm", 12)
    bare = error_from_rpc(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "x",
                                       (("retry-after-ms", "soon"),)))
    assert (bare.retry_after, bare.limit, bare.remaining) == (None, None, None)


def test_last_chunk_carries_finish_reason_and_usage():
    mid = sdk._chunk(gateway_pb2.GenerateResponse(text="a", token_ids=[1], request_id="r"))
    assert (mid.finish_reason, mid.usage, mid.request_id) == (None, None, "r")
    last = sdk._chunk(gateway_pb2.GenerateResponse(
        text="b", token_ids=[2], finish_reason=common_pb2.FINISH_REASON_STOP,
        usage=common_pb2.Usage(prompt_tokens=4, completion_tokens=2), model_version="v1"))
    assert last.finish_reason == "stop" and last.usage == sdk.Usage(4, 2, 0)
    assert sdk._collect([mid, last]) == ("ab", sdk.Usage(4, 2, 0))


def test_sampling_options_are_the_shared_field_list():
    from tokenserve.sampling import FIELDS
    assert sdk._SAMPLING == FIELDS
    assert set(sdk._TOP_LEVEL) == {"temperature", "top_p", "top_k", "seed"}
    req = sdk._chat_request([("user", "hi")], "", 1, {name: 1 for name in FIELDS})
    assert req.temperature == 1 and req.sampling.repetition_penalty == 1


def test_usage_requests_name_dimensions_and_rows_keep_every_field():
    from tokenserve.meter.v1 import meter_pb2
    req = sdk._usage_request(["model", "time"], 10.0, 20.0, 60, "acme")
    assert list(req.group_by) == [meter_pb2.GROUP_BY_MODEL, meter_pb2.GROUP_BY_TIME]
    assert (req.start, req.end, req.bucket_seconds, req.tenant_id) == (10.0, 20.0, 60, "acme")
    assert list(sdk._usage_request("app", 0, 0, 0, "").group_by) == [meter_pb2.GROUP_BY_APP]
    with pytest.raises(ValueError, match="'modle'.*allowed: tenant, app, model, version"):
        sdk._usage_request(["modle"], 0, 0, 0, "")
    (row,) = sdk._usage_rows(gateway_pb2.GetUsageResponse(rows=[meter_pb2.UsageRow(
        keys=["tiny", "3600"], requests=2, prompt_tokens=5, completion_tokens=7,
        cached_tokens=1, energy_joules=1.5, total_tokens=12, tokens_per_joule=8.0,
        energy_estimated=True)]))
    assert row == sdk.UsageRow(("tiny", "3600"), 2, 5, 7, 1, 12, 1.5, 8.0, True)
