"""The gateway and the engine give the same answer at every edge of every sampling limit.

Each case goes through the gateway's public-request validation (from the protobuf the caller
sends) and the engine's Generate validation (from the protobuf the gateway sends); both must
accept it, or both refuse it with INVALID_ARGUMENT and the same message.
"""
from __future__ import annotations

import dataclasses
import math

import pytest

from services.engine.servicer import sampling_from_pb
from services.engine.validation import ModelLimits, validate_request
from services.gateway.downstream import engine_request
from services.gateway.servicer import request_from_pb
from services.gateway.validation import validate
from tokenserve import sampling
from tokenserve.gateway.v1 import gateway_pb2
from tokenserve.runtime.errors import InvalidArgument

S = sampling
EPS = 1e-3
# (field, value) pairs at and just beyond each limit; floats stay exact in float32.
EDGES = [
    ("temperature", 0.0), ("temperature", -EPS), ("temperature", 5.0),
    ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", 1.0), ("top_p", 1.0 + 1 / 64), ("top_p", 0.0), ("top_p", 1 / 1024),
    ("top_k", 0), ("top_k", -1), ("top_k", 50),
    ("min_p", 0.0), ("min_p", 1.0), ("min_p", -1 / 64), ("min_p", 1 + 1 / 64),
    ("repetition_penalty", S.MAX_REPETITION_PENALTY), ("repetition_penalty", S.MAX_REPETITION_PENALTY + 0.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", 1 / 64), ("repetition_penalty", -1.0),
    ("presence_penalty", S.PENALTY_LIMIT), ("presence_penalty", -S.PENALTY_LIMIT),
    ("presence_penalty", S.PENALTY_LIMIT + 1 / 64), ("presence_penalty", -S.PENALTY_LIMIT - 1 / 64),
    ("frequency_penalty", S.PENALTY_LIMIT), ("frequency_penalty", -S.PENALTY_LIMIT - 1 / 64),
    ("frequency_penalty", math.nan),
    ("seed", 0), ("seed", 2**64 - 1),
]
STOPS = [
    ["x"] * S.MAX_STOP_STRINGS, ["x"] * (S.MAX_STOP_STRINGS + 1),
    ["y" * S.MAX_STOP_CHARS], ["y" * (S.MAX_STOP_CHARS + 1)], [""],
]
TOP_LOGPROBS = [0, S.MAX_TOP_LOGPROBS, S.MAX_TOP_LOGPROBS + 1, -1]


def gateway_answer(pb: gateway_pb2.GenerateRequest):
    try:
        return "ok", validate(request_from_pb(pb, chat=False), tier_cap=64, tier="test")
    except InvalidArgument as e:
        return e.message, None


def engine_answer(engine_pb):
    try:
        validate_request(list(engine_pb.prompt_token_ids), sampling_from_pb(engine_pb),
                         engine_pb.max_tokens, list(engine_pb.stop), [],
                         ModelLimits(max_context=128, vocab_size=100))
        return "ok"
    except InvalidArgument as e:
        return e.message


def both(pb: gateway_pb2.GenerateRequest) -> tuple[str, str]:
    gw, req = gateway_answer(pb)
    # What the gateway would send; for a request it refused, the same values sent directly
    # (an engine caller other than the gateway).
    if req is None:
        req = dataclasses.replace(request_from_pb(pb, chat=False), request_id="r")
    engine_pb = engine_request(req, [1, 2, 3], priority=0, tenant_id="t")
    return gw, engine_answer(engine_pb)


def _request(**fields) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt="hi", max_tokens=4, **fields)


@pytest.mark.parametrize("name, value", EDGES, ids=[f"{n}={v}" for n, v in EDGES])
def test_every_sampling_edge_gets_the_same_answer(name, value):
    pb = _request()
    setattr(pb.sampling, name, value)
    gw, engine = both(pb)
    assert gw == engine
    if gw != "ok":
        assert name in gw


@pytest.mark.parametrize("stop", STOPS, ids=lambda s: f"{len(s)}x{len(s[0]) if s else 0}")
def test_stop_limits_are_the_same(stop):
    gw, engine = both(_request(stop=stop))
    assert gw == engine
    over = len(stop) > S.MAX_STOP_STRINGS or any(not s or len(s) > S.MAX_STOP_CHARS for s in stop)
    assert (gw != "ok") == over


@pytest.mark.parametrize("n", TOP_LOGPROBS)
def test_top_logprobs_limits_are_the_same(n):
    gw, engine = both(_request(top_logprobs=n))
    assert gw == engine
    assert (gw == "ok") == (0 <= n <= S.MAX_TOP_LOGPROBS)


def test_top_level_controls_are_overridden_by_the_sampling_message():
    pb = _request(temperature=0.5, top_k=7)
    pb.sampling.temperature = 0.25
    _, req = gateway_answer(pb)
    assert (req.sampling.temperature, req.sampling.top_k) == (0.25, 7)
    engine = sampling_from_pb(engine_request(req, [1], priority=0, tenant_id="t"))
    assert (engine.temperature, engine.top_k) == (0.25, 7)


def test_unset_controls_reach_the_engine_as_the_shared_defaults():
    _, req = gateway_answer(_request())
    engine = sampling_from_pb(engine_request(req, [1], priority=0, tenant_id="t"))
    defaults = sampling.SamplingParams()
    assert all(getattr(engine, f) == getattr(defaults, f) for f in sampling.FIELDS)


def test_penalized_means_some_penalty_differs_from_its_default():
    from tokenserve.sampling import SamplingParams
    assert not SamplingParams().penalized
    for change in ({"repetition_penalty": 1.1}, {"presence_penalty": -0.5},
                   {"frequency_penalty": 0.2}):
        assert SamplingParams(**change).penalized, change
    assert not SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3).penalized
