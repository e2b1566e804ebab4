"""Fuzzing the gateway's request validation (hypothesis): whatever a caller sends, the only
refusal is InvalidArgument whose message starts with the field it is about; nothing else is
raised (anything else would reach the caller as INTERNAL or UNKNOWN).

Three doors, as the servicer uses them: raw bytes through the lenient deserializer, protobuf
requests through `request_from_pb`, and plain requests (strings with lone surrogates, which
no protobuf client can send, as a JSON body could try) straight into `validate`. Bounded:
about 20 s in all on a small machine.
"""
from __future__ import annotations

import re

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from services.gateway.servicer import request_from_pb
from services.gateway.validation import InferenceRequest, Message, validate
from tokenserve.common.v1 import common_pb2
from tokenserve.gateway.v1 import gateway_pb2 as pb
from tokenserve.runtime.errors import InvalidArgument
from tokenserve.runtime.wire import BadRequest, lenient
from tokenserve.sampling import FIELDS as SAMPLING_FIELDS
from tokenserve.sampling import SamplingParams

FIELDS = {"prompt", "messages", "max_tokens", "stop", "request_id", "app", "top_logprobs",
          "sampling", *SAMPLING_FIELDS}
# `field`, `field[3]`, `field[3].sub`, `field.sub`, then a space or a colon
NAMES_A_FIELD = re.compile(r"^([a-z_]+)(\[\d+\])?(\.[a-z_]+)?[ :]")
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

texts = st.one_of(
    st.sampled_from(["", "hi", "a b c"]),
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=300),
    st.sampled_from(["", " ", "\x00", "a\x00b", "ok", "x" * 257, "user", "system"]),
)
surrogate_texts = st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
                          | st.characters(), max_size=40)
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([0.0, -0.0, 1.0, -1.0, 1.5, 2.0, 3.0, 1e-45]))
int32 = st.integers(min_value=-2**31, max_value=2**31 - 1)
huge_ints = st.one_of(int32, st.integers(min_value=-2**70, max_value=2**70))
# Mostly valid values, so that examples get past the first checks to the later ones.
max_tokens = st.one_of(st.integers(1, 64), int32)
small = st.one_of(st.integers(-3, 25), int32)


def check_refusal(err: InvalidArgument) -> None:
    m = NAMES_A_FIELD.match(err.message)
    assert m and m.group(1) in FIELDS, err.message


def check(req: InferenceRequest) -> None:
    try:
        out = validate(req, tier_cap=2048, tier="standard")
    except InvalidArgument as e:
        check_refusal(e)
    else:
        assert out.request_id


sampling_pb = st.builds(common_pb2.SamplingParams, **{
    name: (st.integers(0, 2**64 - 1) if name == "seed" else
           small if name == "top_k" else floats) for name in SAMPLING_FIELDS})
chat_messages = st.lists(st.builds(common_pb2.ChatMessage, role=texts, content=texts),
                         max_size=5)


@st.composite
def pb_requests(draw):
    common = dict(model=draw(texts), max_tokens=draw(max_tokens),
                  stop=draw(st.lists(texts, max_size=20)), request_id=draw(texts),
                  app=draw(texts), top_logprobs=draw(small), logprobs=draw(st.booleans()))
    for name in ("temperature", "top_p"):
        if draw(st.booleans()):
            common[name] = draw(floats)
    if draw(st.booleans()):
        common["top_k"] = draw(small)
    if draw(st.booleans()):
        common["seed"] = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        common["sampling"] = draw(sampling_pb)
    if draw(st.booleans()):
        return pb.ChatRequest(messages=draw(chat_messages), **common), True
    return pb.GenerateRequest(prompt=draw(texts), **common), False


@FUZZ
@given(pb_requests())
def test_protobuf_requests_are_served_or_refused_naming_a_field(request_and_kind):
    request, chat = request_and_kind
    check(request_from_pb(request, chat=chat))


@FUZZ
@given(pb_requests(), st.data())
def test_mangled_bytes_never_get_past_the_deserializer_unnamed(request_and_kind, data):
    request, chat = request_and_kind
    wire = bytearray(request.SerializeToString())
    for _ in range(data.draw(st.integers(0, 4))):  # flip, cut or insert bytes
        if not wire:
            break
        i = data.draw(st.integers(0, len(wire) - 1))
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip":
            wire[i] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del wire[i:]
        else:
            wire[i:i] = data.draw(st.binary(min_size=1, max_size=4))
    parsed = lenient(pb.ChatRequest if chat else pb.GenerateRequest)(bytes(wire))
    if isinstance(parsed, BadRequest):
        assert (" is not valid UTF-8 (bad byte at offset " in parsed.reason
                and NAMES_A_FIELD.match(parsed.reason).group(1) in FIELDS | {"model"}
                or parsed.reason.startswith("the request is not a valid tokenserve.gateway")), \
            parsed.reason
        return
    check(request_from_pb(parsed, chat=chat))


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_parse_or_are_refused(data):
    parsed = lenient(pb.GenerateRequest)(data)
    if isinstance(parsed, BadRequest):
        assert parsed.reason, data
    else:
        check(request_from_pb(parsed, chat=False))


@FUZZ
@given(prompt=st.none() | surrogate_texts,
       messages=st.none() | st.lists(st.builds(Message, role=surrogate_texts,
                                               content=surrogate_texts), max_size=4),
       max_tokens=st.one_of(max_tokens, huge_ints), stop=st.lists(surrogate_texts, max_size=20),
       sampling=st.builds(SamplingParams, temperature=floats, top_p=floats,
                          top_k=st.one_of(small, huge_ints),
                          min_p=floats, repetition_penalty=floats, presence_penalty=floats,
                          frequency_penalty=floats, seed=st.none() | huge_ints),
       request_id=surrogate_texts, app=surrogate_texts,
       top_logprobs=st.one_of(small, huge_ints))
def test_plain_requests_with_any_values_are_served_or_refused_naming_a_field(
        prompt, messages, max_tokens, stop, sampling, request_id, app, top_logprobs):
    assume(prompt is not None or messages is not None)
    check(InferenceRequest(model="m", max_tokens=max_tokens, prompt=prompt,
                           messages=None if messages is None else tuple(messages),
                           sampling=sampling, stop=tuple(stop), request_id=request_id, app=app,
                           top_logprobs=top_logprobs))
