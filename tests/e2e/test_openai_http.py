"""The whole suite as real processes (etcd, meter, tokenizer, SmolLM2 engine, gateway), driven
through the OpenAI-compatible HTTP front by the official `openai` Python package and the
`openai` npm package (Node.js), and through gRPC by the Node.js example client in
clients/node. The npm packages are installed here, from the committed lockfiles, into
node_modules folders next to them (ignored by git)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from controlplane.launcher import Suite, SuitePorts, curl_command
from tokenserve.client import Client
from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc
from tokenserve.models import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NODE_OPENAI = ROOT / "tests" / "e2e" / "node_openai"
NODE_CLIENT = ROOT / "clients" / "node"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    s = Suite(tmp_path_factory.mktemp("suite"), SuitePorts.ephemeral(), say=lambda m: None)
    try:
        s.start(timeout=600)
    except Exception:
        s.stop()
        raise
    yield s
    s.stop()


@pytest.fixture(scope="module")
def key(suite):
    return suite.issue_key()


@pytest.fixture(scope="module")
def client(suite, key):
    with openai.OpenAI(base_url=suite.http_url, api_key=key, max_retries=0, timeout=120) as c:
        yield c


def npm_install(folder: Path) -> None:
    """Installs what the committed lockfile pins (quick when node_modules is up to date)."""
    npm = shutil.which("npm")
    assert npm, "npm is not installed (Node.js 18+ and npm are needed by these tests)"
    subprocess.run([npm, "install", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=folder,
                   check=True, capture_output=True, timeout=300)


def meter_row(suite, request_id: str, timeout: float = 30) -> dict | None:
    """The gateway's usage record of `request_id` as the meter stored it."""
    with grpc.insecure_channel(suite.address("meter")) as ch:
        meter = meter_pb2_grpc.MeterServiceStub(ch)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            csv = "".join(c.data for c in meter.ExportCsv(meter_pb2.QueryUsageRequest(),
                                                          timeout=5))
            header, *lines = csv.splitlines()
            for ln in lines:
                if f",{request_id}," in ln:
                    return dict(zip(header.split(","), ln.split(",")))
            time.sleep(0.2)
    return None


def billed_requests(suite, key: str, at_least: int, timeout: float = 30) -> int:
    """Requests billed to `key`'s tenant (GetUsage), once at least `at_least` have been."""
    with Client(suite.address("gateway"), key, timeout=10) as c:
        end = time.monotonic() + timeout
        while True:
            total = sum(r.requests for r in c.get_usage())
            if total >= at_least or time.monotonic() > end:
                return total
            time.sleep(0.2)


def engine_cancelled(suite) -> float:
    """The engine's count of requests that ended cancelled (its /metrics)."""
    url = f"http://127.0.0.1:{suite.ports.engine_metrics}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith('tokenserve_engine_requests_total{finish_reason="cancelled"}'):
                return float(line.split()[-1])
    return 0.0


def test_chat_completion_from_the_real_model_with_cached_tokens(client):
    first = client.chat.completions.create(model="", messages=QUESTION, max_tokens=24,
                                           temperature=0)
    assert "Paris" in first.choices[0].message.content
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens > 10  # the chat template's system prompt is counted
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    again = client.chat.completions.create(model="", messages=QUESTION, max_tokens=24,
                                           temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    # the same prompt again: its full KV blocks come from the engine's prefix cache
    assert 0 < again.usage.prompt_tokens_details.cached_tokens <= again.usage.prompt_tokens


def test_streamed_chat_with_usage_and_logprobs(client):
    chunks = list(client.chat.completions.create(
        model="", messages=QUESTION, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=2))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens >= 1
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert "Paris" in text
    tokens = [t for c in body if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(tokens) == last.usage.completion_tokens
    assert "".join(t.token for t in tokens).startswith(text)  # + any special token at the end
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens)
    # greedy: the sampled token is the most likely one
    assert all(t.top_logprobs[0].token == t.token for t in tokens)


def test_text_completion_with_logprobs(client):
    resp = client.completions.create(model="", prompt="The capital of France is",
                                     max_tokens=4, temperature=0, logprobs=1)
    lp = resp.choices[0].logprobs
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset[0] == 0 and len(lp.token_logprobs) == resp.usage.completion_tokens


def test_the_curl_line_tokenserve_up_prints_works(suite, key):
    assert shutil.which("curl"), "curl is not installed"
    proc = subprocess.run(curl_command(key, suite.http_url) + " --silent --show-error",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    resp = json.loads(proc.stdout)
    assert "Paris" in resp["choices"][0]["message"]["content"]


def test_errors_are_typed(suite, client):
    with pytest.raises(openai.NotFoundError, match="smollm2"):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=QUESTION, max_tokens=4, top_p=0)
    assert err.value.body["param"] == "top_p"
    with openai.OpenAI(base_url=suite.http_url, api_key="ts-nope", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(model="", messages=QUESTION, max_tokens=4)


def test_leaving_a_stream_cancels_the_engine_and_bills_what_was_sent(suite, client):
    cancelled_before = engine_cancelled(suite)
    stream = client.chat.completions.create(
        model="", max_tokens=200, stream=True,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        extra_headers={"x-request-id": "http-e2e-leave"})
    received = 0
    for _ in stream:
        received += 1
        if received == 3:
            break
    stream.close()
    row = meter_row(suite, "http-e2e-leave")
    assert row is not None, "the usage record never reached the meter"
    assert row["status"] == "CANCELLED"
    assert 3 <= int(row["completion_tokens"]) < 200
    end = time.monotonic() + 10
    while engine_cancelled(suite) == cancelled_before and time.monotonic() < end:
        time.sleep(0.1)
    assert engine_cancelled(suite) == cancelled_before + 1  # the engine stopped the request


def test_the_openai_npm_package_streams_a_chat(suite, key):
    npm_install(NODE_OPENAI)
    proc = subprocess.run(["node", "chat.mjs"], cwd=NODE_OPENAI, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TOKENSERVE_BASE_URL": suite.http_url,
                                            "TOKENSERVE_API_KEY": key})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Paris" in out["text"] and out["finish"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] >= 1
    assert out["error"] == {"name": "AuthenticationError", "status": 401}


def test_the_node_grpc_client_streams_a_chat(suite, key):
    npm_install(NODE_CLIENT)
    proc = subprocess.run(["node", "chat.js", "--json", suite.address("gateway")],
                          cwd=NODE_CLIENT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TOKENSERVE_API_KEY": key})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Paris" in out["text"]
    assert out["finishReason"] in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH")
    assert out["usage"]["completion_tokens"] >= 1 and out["requestId"]


def test_readme_python_examples_run(suite, key):
    text = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) == 4
    env = {**os.environ, "TOKENSERVE_GATEWAY": suite.address("gateway"),
           "TOKENSERVE_API_KEY": key, "OPENAI_BASE_URL": suite.http_url, "OPENAI_API_KEY": key}
    outputs, billed = [], 0
    for i, block in enumerate(blocks):
        if i == 3:  # the usage example: wait until the blocks before it reached the meter
            billed = billed_requests(suite, key, at_least=4)
        proc = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                              timeout=180, env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout)
    openai_example, sdk_example, errors_example, usage_example = outputs
    assert "Paris" in openai_example and "prompt tokens cached" in openai_example
    assert "completion_tokens=" in sdk_example
    assert "Paris" in errors_example
    assert "fix the request: max_tokens must be >= 1" in errors_example
    lines = usage_example.splitlines()
    assert lines and all(ln.startswith(f"{DEFAULT_MODEL_NAME} app=") for ln in lines), lines
    assert all(ln.endswith("tokens/J") for ln in lines), lines
    # the four billed calls of the blocks before it, and the earlier tests' with this key
    assert billed >= 4
    assert sum(int(ln.split(": ", 1)[1].split(" requests")[0]) for ln in lines) >= billed
