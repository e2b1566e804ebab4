"""The whole suite as real processes (etcd, meter, tokenizer, engine, gateway) on ephemeral
ports, driven through the public API with the real grpcurl binary (reflection only, no .proto
files) and with the generated Python stubs.

Tests in this module share one running suite and run in file order; the SIGTERM test is
last because it stops the services.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controlplane.launcher import SERVICES, Suite, SuitePorts
from tokenserve.common.v1 import common_pb2
from tokenserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc

pytestmark = pytest.mark.slow

GRPCURL = str(Path(sys.executable).parent / "grpcurl")
TSCTL = [sys.executable, "-m", "controlplane.tsctl"]
CHAT = "tokenserve.gateway.v1.InferenceService/Chat"
GENERATE = "tokenserve.gateway.v1.InferenceService/Generate"
# A prompt word that no usage column could hold by chance.
MARKER = "quokka7e2emarker"


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


def grpcurl(suite, method: str, body: dict, key: str | None = None, timeout: float = 120):
    """Runs grpcurl; returns (exit code, list of JSON messages, stderr)."""
    cmd = [GRPCURL, "-plaintext", "-max-time", str(int(timeout))]
    if key is not None:
        cmd += ["-H", f"authorization: Bearer {key}"]
    cmd += ["-d", json.dumps(body), suite.address("gateway"), method]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30)
    messages, text, decoder, i = [], proc.stdout, json.JSONDecoder(), 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            break
        obj, i = decoder.raw_decode(text, i)
        messages.append(obj)
    return proc.returncode, messages, proc.stderr


def stub(suite):
    channel = grpc.insecure_channel(suite.address("gateway"))
    return channel, gateway_pb2_grpc.InferenceServiceStub(channel)


def auth(key):
    return (("authorization", f"Bearer {key}"),)


def stored_values(db: Path) -> str:
    """Every value in every row of every table of a SQLite database, one per line."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return "\n".join(v.decode(errors="replace") if isinstance(v, bytes) else str(v)
                         for t in tables for row in conn.execute(f'SELECT * FROM "{t}"')
                         for v in row)


def wait_for(predicate, timeout=10.0, interval=0.1):
    """Polls predicate until it returns a truthy value (bounded); returns that value or None."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def test_every_service_reports_serving(suite):
    for name in SERVICES:
        with grpc.insecure_channel(suite.address(name)) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, name


def test_grpcurl_chat_gets_coherent_text_from_the_real_model(suite, key):
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24}
    code, messages, err = grpcurl(suite, CHAT, body, key)
    assert code == 0, err
    text = "".join(m.get("text", "") for m in messages)
    assert "Paris" in text
    last = messages[-1]
    assert last["finish_reason"] in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH")
    streamed_ids = [t for m in messages for t in m.get("token_ids", [])]
    assert last["usage"]["completion_tokens"] == len(streamed_ids)
    assert last["usage"]["prompt_tokens"] > 10  # the chat template's system prompt is counted
    assert last["request_id"] and last["model_version"]


def test_usage_matches_streamed_tokens_and_reaches_the_meter(suite, key):
    channel, api = stub(suite)
    with channel:
        req = gateway_pb2.GenerateRequest(prompt=f"Once upon a time {MARKER}", max_tokens=12,
                                          request_id="e2e-usage-1")
        chunks = list(api.Generate(req, metadata=auth(key), timeout=120))
    ids = [t for c in chunks for t in c.token_ids]
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(ids) > 0
    assert chunks[-1].request_id == "e2e-usage-1"
    completion = "".join(c.text for c in chunks).strip()
    assert completion

    with grpc.insecure_channel(suite.address("meter")) as ch:
        meter = meter_pb2_grpc.MeterServiceStub(ch)

        def stored():
            csv = "".join(c.data for c in meter.ExportCsv(meter_pb2.QueryUsageRequest(), timeout=5))
            rows = [line for line in csv.splitlines() if "e2e-usage-1" in line]
            return rows

        rows = wait_for(stored, timeout=30)
    assert rows, "the usage event never reached the meter"
    gateway_rows = [r for r in rows if "GATEWAY" in r.upper()]
    assert len(gateway_rows) == 1
    assert f",{usage.prompt_tokens}," in gateway_rows[0]
    assert f",{usage.completion_tokens}," in gateway_rows[0]
    # The meter's and the gateway spool's stored rows hold the request id (so the search does
    # see them) but neither the prompt nor the completion.
    stored = "\n".join(stored_values(suite.data_dir / db)
                       for db in ("meter.db", "gateway-spool.db"))
    assert "e2e-usage-1" in stored
    assert MARKER not in stored
    assert completion not in stored


@pytest.mark.parametrize("key_value", [None, "ts-not-a-real-key"])
def test_unauthenticated_without_key_or_with_wrong_key(suite, key_value):
    code, _, err = grpcurl(suite, GENERATE, {"prompt": "hi", "max_tokens": 4}, key_value)
    assert code != 0
    assert "Unauthenticated" in err


def test_invalid_arguments_name_the_field(suite, key):
    code, _, err = grpcurl(suite, GENERATE, {"prompt": "", "max_tokens": 4}, key)
    assert "InvalidArgument" in err and "prompt" in err
    for bad in (0, -3):
        code, _, err = grpcurl(suite, GENERATE, {"prompt": "hi", "max_tokens": bad}, key)
        assert "InvalidArgument" in err and "max_tokens" in err


def test_key_issued_live_works_and_revoked_key_is_refused(suite):
    out = subprocess.run(TSCTL + ["--endpoints", suite.etcd_endpoint, "--json", "key", "issue", "demo"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    new_key = json.loads(out.stdout)["key"]
    channel, api = stub(suite)
    req = gateway_pb2.GenerateRequest(prompt="Hello", max_tokens=2)

    def works():
        try:
            list(api.Generate(req, metadata=auth(new_key), timeout=60))
            return True
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED
            return False

    with channel:
        assert wait_for(works, timeout=10)
        prefix = new_key[:10]
        out = subprocess.run(TSCTL + ["--endpoints", suite.etcd_endpoint, "key", "revoke", prefix],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr

        def refused():
            try:
                list(api.Generate(req, metadata=auth(new_key), timeout=60))
                return False
            except grpc.RpcError as e:
                return e.code() == grpc.StatusCode.UNAUTHENTICATED

        assert wait_for(refused, timeout=10)


def config_revisions(suite) -> dict[str, float]:
    """Each service's tokenserve_<service>_config_revision gauge, for those that watch etcd."""
    import urllib.request

    found = {}
    for name in SERVICES:
        port = getattr(suite.ports, f"{name}_metrics")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(f"tokenserve_{name}_config_revision "):
                    found[name] = float(line.split()[1])
    return found


def test_tier_change_applies_live_to_every_watching_service(suite, key):
    before = config_revisions(suite)
    assert {"gateway", "tokenizer"} <= set(before), before
    out = subprocess.run(TSCTL + ["--endpoints", suite.etcd_endpoint, "tier", "set", "standard",
                                  "--max-tokens", "7"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    try:
        def applied():
            now = config_revisions(suite)
            return now if all(now[n] > before[n] for n in before) else None

        now = wait_for(applied, timeout=10)
        assert now, f"not every service saw the change: {config_revisions(suite)} (before {before})"
        assert len(set(now.values())) == 1, now  # all at the same revision
        code, _, err = grpcurl(suite, GENERATE, {"prompt": "hi", "max_tokens": 8}, key)
        assert "InvalidArgument" in err and "at most 7" in err
    finally:
        subprocess.run(TSCTL + ["--endpoints", suite.etcd_endpoint, "tier", "set", "standard",
                                "--max-tokens", "2048"], capture_output=True, timeout=60)


def test_sigterm_goes_not_serving_then_exits_cleanly(suite):
    for name in reversed(SERVICES):
        proc = suite.procs[name].proc
        channel = grpc.insecure_channel(suite.address(name))
        health = health_pb2_grpc.HealthStub(channel)
        proc.send_signal(signal.SIGTERM)

        def not_serving():
            try:
                resp = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.RpcError:
                return False
            return resp.status == health_pb2.HealthCheckResponse.NOT_SERVING

        assert wait_for(not_serving, timeout=10, interval=0.02), f"{name} never reported NOT_SERVING"
        channel.close()
        assert proc.wait(timeout=60) == 0, f"{name} exited with {proc.returncode}"
