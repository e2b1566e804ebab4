"""The OpenAI-compatible HTTP front of the real gateway process (real etcd, real meter; FAKE
tokenizer and engine, see fakes.py), driven by the official `openai` Python package, plus a
schemathesis run against the OpenAPI document the gateway serves."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from controlplane.schema import Tenant
from tests.integration.gateway.conftest import FREE_MAX_TOKENS, start_gateway
from tests.integration.gateway.fakes import MODEL
from tests.integration.gateway.test_gateway_with_fakes import meter_rows, wait_for


@pytest.fixture
def client(gateway, key):
    with openai.OpenAI(base_url=gateway.http_url, api_key=key, max_retries=0,
                       timeout=30) as c:
        yield c


def test_chat_completion_with_usage(client, meter_stub):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=3,
        temperature=0, extra_headers={"x-request-id": "http-chat-1"})
    assert resp.id == "chatcmpl-http-chat-1" and resp.object == "chat.completion"
    assert resp.model == MODEL
    (choice,) = resp.choices
    assert choice.message.role == "assistant" and choice.message.content == "w0 w1 w2 "
    assert choice.finish_reason == "length"
    # fake tokenizer: 2 words + 2 per message + 1 for the generation prompt
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (5, 3)
    assert resp.usage.total_tokens == 8
    assert resp.usage.prompt_tokens_details.cached_tokens == 1
    (row,) = wait_for(lambda: meter_rows(meter_stub, "http-chat-1"))
    assert (row["status"], row["completion_tokens"]) == ("OK", "3")


def test_streamed_chat_and_completion_end_with_a_usage_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "w0 w1 w2 w3 "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 4
    assert all(c.usage is None for c in body)

    stream = client.completions.create(model=MODEL, prompt="a b c", max_tokens=2, stream=True)
    parts = list(stream)
    assert "".join(p.choices[0].text for p in parts) == "w0 w1 "
    assert all(p.usage is None for p in parts)  # no include_usage: no usage chunk


@pytest.mark.parametrize("value", [False, True])
def test_the_speculation_extension_reaches_the_engine(client, engine, value):
    rid = f"http-spec-{value}"
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=2, extra_body={"speculation": value},
                                   extra_headers={"x-request-id": rid})
    client.completions.create(model=MODEL, prompt="a b", max_tokens=2,
                              extra_body={"speculation": value},
                              extra_headers={"x-request-id": rid + "-c"})
    sent = {r.request_id: r for r in engine.servicer.requests}
    for r in (sent[rid], sent[rid + "-c"]):
        assert r.HasField("speculation") and r.speculation is value
    client.completions.create(model=MODEL, prompt="a b", max_tokens=2,
                              extra_headers={"x-request-id": rid + "-unset"})
    assert not {r.request_id: r for r in engine.servicer.requests}[rid + "-unset"].HasField(
        "speculation")


def test_completion_and_models(client):
    resp = client.completions.create(model=MODEL, prompt="a b c", max_tokens=2, stop=["zz"])
    assert resp.object == "text_completion" and resp.choices[0].text == "w0 w1 "
    assert resp.usage.prompt_tokens == 3
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {MODEL, "lonely"}
    assert models[MODEL].model_extra["max_context"] == 64


@pytest.mark.parametrize("kwargs, error, param, text", [
    ({"max_tokens": FREE_MAX_TOKENS + 1}, openai.BadRequestError, "max_tokens",
     f"at most {FREE_MAX_TOKENS}"),
    ({"max_tokens": 2, "n": 2}, openai.BadRequestError, "n", "n must be 1"),
    ({"max_tokens": 2, "temperature": -1}, openai.BadRequestError, "temperature", ">= 0"),
    ({"max_tokens": 2, "messages": [{"role": "robot", "content": "x"}]},
     openai.BadRequestError, "messages[0].role", "messages[0].role"),
    ({"max_tokens": 2, "messages": [{"role": "user"}] * 0}, openai.BadRequestError,
     "messages", "at least one"),
    ({"max_tokens": 2, "model": "gpt-9"}, openai.NotFoundError, None, MODEL),
    ({"max_tokens": 2, "model": "lonely"}, openai.InternalServerError, None, "lonely"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "w " * 60}]},
     openai.BadRequestError, None, "context of 64"),
])
def test_errors_are_openai_shaped_and_typed(client, kwargs, error, param, text):
    args = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(error) as err:
        client.chat.completions.create(**args)
    assert text in err.value.message
    assert err.value.body["param"] == param
    if error is openai.InternalServerError:
        assert err.value.status_code == 503 and err.value.body["type"] == "service_unavailable"


def test_keys_are_checked(gateway, control):
    with openai.OpenAI(base_url=gateway.http_url, api_key="ts-wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError, match="invalid or revoked"):
            c.models.list()
    control.put(Tenant("off", "Off Inc", "free", enabled=False))
    key = control.issue_key("off")
    with openai.OpenAI(base_url=gateway.http_url, api_key=key, max_retries=0) as c:
        def refused():
            try:
                c.models.list()
            except openai.PermissionDeniedError as e:
                return e
            return None
        assert "disabled" in wait_for(refused).message


def test_malformed_bodies_name_the_field(gateway, key):
    def post(body: bytes):
        req = urllib.request.Request(f"{gateway.http_url}/chat/completions", data=body,
                                     headers={"authorization": f"Bearer {key}",
                                              "content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        return err.value.code, json.loads(err.value.read())["error"]

    status, error = post(b"{not json")
    assert status == 400 and "not valid JSON" in error["message"]
    status, error = post(json.dumps({"model": MODEL, "messages": "hi"}).encode())
    assert status == 400 and error["param"] == "messages"
    assert error["type"] == "invalid_request_error"


def test_leaving_a_stream_cancels_the_engine_call_and_bills_what_was_sent(
        gateway, key, engine, meter_stub):
    engine.servicer.cancel_seen.clear()
    engine.servicer.delay, delay = 0.5, engine.servicer.delay
    try:
        with openai.OpenAI(base_url=gateway.http_url, api_key=key, max_retries=0) as c:
            stream = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "go"}], stream=True,
                max_tokens=FREE_MAX_TOKENS, extra_headers={"x-request-id": "http-leave-1"})
            got = [next(iter(stream)).choices[0].delta.content]
            stream.close()
        assert engine.servicer.cancel_seen.wait(10)
    finally:
        engine.servicer.delay = delay
    assert "http-leave-1" in engine.servicer.cancelled
    (row,) = wait_for(lambda: meter_rows(meter_stub, "http-leave-1"))
    assert row["status"] == "CANCELLED"
    assert len(got) <= int(row["completion_tokens"]) < FREE_MAX_TOKENS


def test_schemathesis_finds_no_server_error(gateway, key, tmp_path):
    """Bounded: a handful of generated requests per operation, valid and invalid."""
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "schemathesis"), "run",
         gateway.http_url.removesuffix("/v1") + "/openapi.json",
         "--checks", "not_a_server_error", "--max-examples", "6", "--seed", "1",
         "--phases", "examples,fuzzing", "--header", f"authorization: Bearer {key}",
         "--request-timeout", "20", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_sigterm_lets_a_running_http_stream_finish(workdir, control, key, tokenizer, engine,
                                                   meter):
    gw = start_gateway(workdir, control.endpoint, tokenizer.target, meter.target,
                       [engine.target], name="gateway-http-stop")
    engine.servicer.delay, delay = 0.2, engine.servicer.delay
    try:
        with openai.OpenAI(base_url=gw.http_url, api_key=key, max_retries=0) as c:
            stream = c.completions.create(model=MODEL, prompt="go", max_tokens=8, stream=True)
            parts = [next(iter(stream)).choices[0].text]
            gw.proc.proc.send_signal(signal.SIGTERM)  # 7 tokens (1.4 s) left, 5 s of grace
            parts += [p.choices[0].text for p in stream]
    finally:
        engine.servicer.delay = delay
        code = gw.stop()
    assert "".join(parts) == "".join(f"w{i} " for i in range(8))
    assert code == 0
