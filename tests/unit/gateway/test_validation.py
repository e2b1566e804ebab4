"""Bad public requests are refused with a message naming the field and the limit."""
from __future__ import annotations

import dataclasses

import pytest

from services.gateway.validation import (InferenceRequest, Message, check_context,
                                         validate)
from tokenserve.runtime.errors import InvalidArgument
from tokenserve.sampling import SamplingParams

GOOD = InferenceRequest(model="", max_tokens=8, prompt="hello")
CHAT = InferenceRequest(model="", max_tokens=8, messages=(Message("user", "hi"),))


def check(req):
    return validate(req, tier_cap=16, tier="free")


def test_good_requests_get_a_request_id():
    a, b = check(GOOD), check(CHAT)
    assert a.request_id and b.request_id and a.request_id != b.request_id
    assert check(dataclasses.replace(GOOD, request_id="mine-1")).request_id == "mine-1"


@pytest.mark.parametrize("change, named", [
    ({"prompt": ""}, "prompt"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_tokens": -3}, "max_tokens must be >= 1"),
    ({"max_tokens": 17}, "free tier allows at most 16"),
    ({"sampling": SamplingParams(temperature=-0.1)}, "temperature"),
    ({"sampling": SamplingParams(temperature=float("nan"))}, "temperature"),
    ({"sampling": SamplingParams(top_p=0.0)}, "top_p"),
    ({"sampling": SamplingParams(top_p=1.5)}, "top_p"),
    ({"sampling": SamplingParams(top_k=-1)}, "top_k"),
    ({"sampling": SamplingParams(min_p=2.0)}, "min_p"),
    ({"sampling": SamplingParams(repetition_penalty=0.0)}, "repetition_penalty"),
    ({"sampling": SamplingParams(presence_penalty=3.0)}, "presence_penalty"),
    ({"sampling": SamplingParams(seed=-1)}, "seed"),
    ({"sampling": SamplingParams(seed=2 ** 64)}, "seed"),
    ({"stop": tuple("abcdefghijklmnopq")}, "at most 16"),
    ({"stop": ("",)}, r"stop\[0\]"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"request_id": "has space"}, "request_id"),
    ({"app": "x" * 65}, "app"),
    ({"prompt": "ab\x00c"}, "prompt contains a NUL character at offset 2"),
    # 300,000 four-byte characters: under the character limit, over the tokenizer's bytes
    ({"prompt": "\U0001f600" * 300_000}, "prompt is 1200000 bytes of UTF-8; at most 1048576"),
])
def test_bad_generate_fields_are_named(change, named):
    with pytest.raises(InvalidArgument, match=named):
        check(dataclasses.replace(GOOD, **change))


@pytest.mark.parametrize("messages, named", [
    ((), "at least one message"),
    ((Message("wizard", "hi"),), r"messages\[0\].role"),
    ((Message("user", "ok"), Message("tool", "x")), r"messages\[1\].role"),
    ((Message("user", ""),), "empty"),
    ((Message("user", "ok"), Message("user", "\x00")), r"messages\[1\].content contains a NUL"),
    ((Message("user", "\u00e9" * 300_000), Message("user", "\u00e9" * 300_000)),
     "messages is 1200000 bytes of UTF-8; at most 1048576"),
])
def test_bad_chat_messages_are_named(messages, named):
    with pytest.raises(InvalidArgument, match=named):
        check(dataclasses.replace(CHAT, messages=messages))


def test_prompt_and_completion_must_fit_the_context():
    check_context(prompt_tokens=50, max_tokens=14, max_context=64)
    check_context(prompt_tokens=500, max_tokens=14, max_context=0)  # unknown context: engine checks
    with pytest.raises(InvalidArgument, match="context of 64"):
        check_context(prompt_tokens=51, max_tokens=14, max_context=64)
