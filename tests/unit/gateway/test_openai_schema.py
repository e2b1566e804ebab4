"""OpenAI request bodies -> the pipeline's InferenceRequest, and the served OpenAPI document."""
from __future__ import annotations

from dataclasses import fields

import pytest

from services.gateway.openai_schema import (NOT_OVER_HTTP, OPENAI_NAMES, ChatCompletionRequest,
                                            CompletionRequest, chat_request, completion_request,
                                            openapi_document)
from tokenserve import sampling
from tokenserve.runtime.errors import InvalidArgument


def chat(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return chat_request(ChatCompletionRequest.model_validate(body), default_max_tokens=64,
                        request_id="r")


def test_chat_fields_reach_the_request():
    req = chat(model="m", max_tokens=5, temperature=0.5, top_p=0.9, seed=7, stop="END",
               user="app-1", logprobs=True, top_logprobs=3, presence_penalty=0.1,
               messages=[{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]}])
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"),
                                                            ("user", "ab")]
    assert (req.model, req.max_tokens, req.stop, req.app) == ("m", 5, ("END",), "app-1")
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.seed) == (0.5, 0.9, 7)
    assert req.sampling.presence_penalty == 0.1
    assert (req.logprobs, req.top_logprobs, req.request_id) == (True, 3, "r")


def test_max_tokens_defaults_to_the_tier_cap_and_the_newer_name_wins():
    assert chat().max_tokens == 64
    assert chat(max_tokens=5, max_completion_tokens=7).max_tokens == 7
    assert chat(max_tokens=5, max_completion_tokens=0).max_tokens == 0  # validate() refuses it


@pytest.mark.parametrize("body, text", [
    ({"n": 2}, "n must be 1"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
])
def test_unsupported_chat_options_are_refused(body, text):
    with pytest.raises(InvalidArgument, match=text):
        chat(**body)


def test_completion_prompt_forms_and_logprobs():
    def completion(**body):
        return completion_request(CompletionRequest.model_validate(body),
                                  default_max_tokens=64, request_id="r")

    req = completion(prompt=["once"], logprobs=2, stop=["a", "b"])
    assert (req.prompt, req.messages, req.logprobs, req.top_logprobs) == ("once", None, True, 2)
    assert req.stop == ("a", "b")
    assert completion(prompt="x", logprobs=0).logprobs is True
    assert completion(prompt="x").logprobs is False
    with pytest.raises(InvalidArgument, match="exactly one"):
        completion(prompt=["a", "b"])
    with pytest.raises(InvalidArgument, match="echo"):
        completion(prompt="a", echo=True)


def test_openapi_document_names_every_operation_and_its_errors():
    doc = openapi_document("t", "1")
    assert set(doc["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    chat_op = doc["paths"]["/v1/chat/completions"]["post"]
    assert {"400", "401", "403", "404", "429", "503", "504"} <= set(chat_op["responses"])
    schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "max_tokens", "stream_options", "logprobs"} <= set(schema["properties"])
    assert schema["required"] == ["messages"]


def test_every_sampling_control_is_mapped_or_explicitly_not_over_http():
    # A control added to tokenserve.sampling fails here until OPENAI_NAMES or NOT_OVER_HTTP
    # takes it.
    assert set(OPENAI_NAMES).isdisjoint(NOT_OVER_HTTP)
    assert set(OPENAI_NAMES) | NOT_OVER_HTTP == set(sampling.FIELDS)
    assert len(set(OPENAI_NAMES.values())) == len(OPENAI_NAMES)


def _non_default(f):
    """A valid value of the control `f` other than its default."""
    return {"float": 0.25, "int": 3, "int | None": 3}[f.type]


def test_every_mapped_control_reaches_the_request_and_the_rest_keep_their_defaults():
    controls = {f.name: f for f in fields(sampling.SamplingParams)}
    body = {OPENAI_NAMES[name]: _non_default(controls[name]) for name in OPENAI_NAMES}
    body.update({name: _non_default(controls[name]) for name in NOT_OVER_HTTP})  # ignored
    for req in (chat(**body), completion_request(CompletionRequest.model_validate(
            {**body, "prompt": "x"}), default_max_tokens=8, request_id="r")):
        got = {name: getattr(req.sampling, name) for name in sampling.FIELDS}
        assert got == {name: body[OPENAI_NAMES[name]] if name in OPENAI_NAMES
                       else controls[name].default for name in sampling.FIELDS}
    assert chat().sampling == sampling.SamplingParams()  # nothing set: greedy defaults


def test_the_openapi_document_lists_the_mapped_controls_and_the_shared_limits():
    doc = openapi_document("t", "1")
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = doc["components"]["schemas"][name]["properties"]
        assert set(OPENAI_NAMES.values()) <= set(props)
        assert not NOT_OVER_HTTP & set(props)
        assert f"up to {sampling.MAX_STOP_STRINGS} stop strings" in props["stop"]["description"]
