"""Every bad Generate input is INVALID_ARGUMENT naming the field and the limit."""
from __future__ import annotations

import math

import pytest

from services.engine.interface import SamplingParams
from services.engine.validation import ModelLimits, validate_request
from tokenserve.runtime.errors import InvalidArgument

LIMITS = ModelLimits(max_context=100, vocab_size=50)


def check(prompt=(1, 2, 3), max_tokens=5, stop=(), stop_ids=(), **sampling):
    validate_request(list(prompt), SamplingParams(**sampling), max_tokens, list(stop),
                     list(stop_ids), LIMITS)


def test_a_good_request_passes():
    check(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
          presence_penalty=-2, frequency_penalty=2, top_logprobs=20, logprobs=True,
          stop=["\n\n"], stop_ids=[49], max_tokens=97)


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=-0.1), ["temperature", ">= 0"]),
    (dict(temperature=math.nan), ["temperature", "finite"]),
    (dict(temperature=math.inf), ["temperature", "finite"]),
    (dict(top_p=0.0), ["top_p", "(0, 1]"]),
    (dict(top_p=1.01), ["top_p", "(0, 1]"]),
    (dict(top_k=-1), ["top_k", ">= 0"]),
    (dict(min_p=1.5), ["min_p", "[0, 1]"]),
    (dict(min_p=-0.1), ["min_p", "[0, 1]"]),
    (dict(repetition_penalty=0.0), ["repetition_penalty", "(0, 10]"]),
    (dict(presence_penalty=2.5), ["presence_penalty", "[-2, 2]"]),
    (dict(frequency_penalty=-3.0), ["frequency_penalty", "[-2, 2]"]),
    (dict(frequency_penalty=math.nan), ["frequency_penalty", "finite"]),
    (dict(top_logprobs=21), ["top_logprobs", "20"]),
    (dict(top_logprobs=-1), ["top_logprobs", "20"]),
    (dict(max_tokens=0), ["max_tokens", ">= 1"]),
    (dict(max_tokens=-5), ["max_tokens", ">= 1"]),
    (dict(max_tokens=98), ["max_tokens", "at most 97"]),
    (dict(prompt=()), ["prompt_token_ids", "empty"]),
    (dict(prompt=[1] * 100), ["prompt_token_ids", "at most 99"]),
    (dict(prompt=[1, 50]), ["prompt_token_ids[1]", "[0, 50)"]),
    (dict(prompt=[-1]), ["prompt_token_ids[0]", "[0, 50)"]),
    (dict(stop_ids=[7, 99]), ["stop_token_ids[1]", "[0, 50)"]),
    (dict(stop=[""]), ["stop[0]", "1-256"]),
    (dict(stop=["x"] * 17), ["stop", "16"]),
])
def test_bad_inputs_name_the_field_and_the_limit(kwargs, words):
    with pytest.raises(InvalidArgument) as e:
        check(**kwargs)
    for w in words:
        assert w in e.value.message
