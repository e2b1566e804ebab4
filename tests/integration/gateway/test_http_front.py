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
from tests.integration.gateway.fakes import MODEL, fake_engine
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


# Errors the gRPC API shares are in the bad-input table (tests/bad_input.py, run over both
# APIs by test_bad_input.py); these are the HTTP API's own.
@pytest.mark.parametrize("kwargs, error, param, text", [
    ({"max_tokens": 2, "n": 2}, openai.BadRequestError, "n", "n must be 1"),
    ({"max_tokens": 2, "top_logprobs": 3}, openai.BadRequestError, "top_logprobs",
     "top_logprobs needs logprobs: true"),
    ({"max_tokens": 2, "model": "lonely"}, openai.InternalServerError, None, "lonely"),
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


@pytest.fixture(scope="module")
def slow_gateway(workdir, control, key, tokenizer, meter):
    """A gateway whose requests have 1 s, over an engine of its own that sends a token every
    0.4 s (2 tokens fit in the deadline)."""
    engine = fake_engine(delay=0.4)
    gw = start_gateway(workdir, control.endpoint, tokenizer.target, meter.target,
                       [engine.target], name="gateway-deadline",
                       extra_args=["--request-timeout", "1"])
    yield gw, engine
    gw.stop()
    engine.stop()


def post_chat(gw, key: str, body: dict, request_id: str):
    req = urllib.request.Request(
        f"{gw.http_url}/chat/completions",
        data=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "go"}],
                         **body}).encode(),
        headers={"authorization": f"Bearer {key}", "content-type": "application/json",
                 "x-request-id": request_id})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=20)
    return err.value.code, err.value.headers, json.loads(err.value.read())


def test_a_request_past_its_deadline_is_a_504_billed_for_what_the_engine_made(
        slow_gateway, key, meter_stub):
    gw, engine = slow_gateway
    status, headers, body = post_chat(gw, key, {"max_tokens": FREE_MAX_TOKENS}, "http-late-1")
    assert status == 504 and headers["content-type"].startswith("application/json")
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "timeout_error" and body["error"]["param"] is None
    assert "deadline" in body["error"]["message"].lower()
    # the engine stopped at the deadline, not after all FREE_MAX_TOKENS tokens
    assert wait_for(lambda: "http-late-1" in engine.servicer.cancelled)
    (row,) = wait_for(lambda: meter_rows(meter_stub, "http-late-1"))
    assert row["status"] == "DEADLINE_EXCEEDED"
    assert row["prompt_tokens"] == "4" and int(row["completion_tokens"]) <= 2

    # the openai package raises it as a typed error with the same body
    with openai.OpenAI(base_url=gw.http_url, api_key=key, max_retries=0, timeout=20) as c:
        with pytest.raises(openai.InternalServerError) as err:
            c.completions.create(model=MODEL, prompt="go", max_tokens=FREE_MAX_TOKENS)
    assert err.value.status_code == 504 and err.value.body["type"] == "timeout_error"


def test_a_stream_with_no_token_before_its_deadline_is_a_504(slow_gateway, key, meter_stub):
    gw, engine = slow_gateway
    engine.servicer.delay = 1.5
    try:
        status, _, body = post_chat(gw, key, {"max_tokens": 4, "stream": True}, "http-late-2")
    finally:
        engine.servicer.delay = 0.4
    assert status == 504 and body["error"]["type"] == "timeout_error"
    (row,) = wait_for(lambda: meter_rows(meter_stub, "http-late-2"))
    assert (row["status"], row["completion_tokens"]) == ("DEADLINE_EXCEEDED", "0")


def test_a_stream_past_its_deadline_ends_with_an_error_event_billing_what_was_sent(
        slow_gateway, key, meter_stub):
    gw, _ = slow_gateway
    got = []
    with openai.OpenAI(base_url=gw.http_url, api_key=key, max_retries=0, timeout=20) as c:
        stream = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go"}], stream=True,
            max_tokens=FREE_MAX_TOKENS, extra_headers={"x-request-id": "http-late-3"})
        # the status line (200) went out with the first token: the error is an SSE event
        with pytest.raises(openai.APIError) as err:
            for chunk in stream:
                got += [chunk.choices[0].delta.content] if chunk.choices[0].delta.content else []
    assert err.value.body["type"] == "timeout_error"
    assert 1 <= len(got) <= 2 and got == [f"w{i} " for i in range(len(got))]
    (row,) = wait_for(lambda: meter_rows(meter_stub, "http-late-3"))
    assert row["status"] == "DEADLINE_EXCEEDED"
    assert int(row["completion_tokens"]) == len(got)  # billed exactly the tokens it got
