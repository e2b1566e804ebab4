"""The gateway in front of the REAL tokenizer and engine (SmolLM2-135M on the CPU), with a
real etcd (the engine registers itself; the gateway has no --engine flag) and a real meter."""
from __future__ import annotations

import time

import grpc
import pytest

from controlplane.schema import ModelSpec, ModelVersion, Route, Tenant, Tier
from controlplane.service_process import ServiceProcess
from tokenserve.runtime.ports import free_port
from tests.integration.gateway.conftest import Control
from tokenserve.client import Client
from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tokenserve.models import DEFAULT_MODEL_NAME, DEFAULT_MODEL_VERSION, default_model_path
from tokenserve.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

pytestmark = pytest.mark.slow


def wait_for(predicate, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return None


@pytest.fixture(scope="module")
def suite(tmp_path_factory, etcd_session):
    tmp = tmp_path_factory.mktemp("real")
    etcd_session.clear()
    control = Control(etcd_session.endpoint)
    control.put(Tier("standard", 50, 100_000, 5_000_000, 16, 1, 64),
                Tenant("acme", "Acme", "standard"),
                ModelSpec(DEFAULT_MODEL_NAME, {DEFAULT_MODEL_VERSION: ModelVersion(
                    f"builtin:{DEFAULT_MODEL_NAME}", 2048)}, DEFAULT_MODEL_VERSION),
                Route(DEFAULT_MODEL_NAME, {DEFAULT_MODEL_VERSION: 1}))
    key = control.issue_key("acme")
    model = str(default_model_path())
    ports = {n: free_port() for n in ("meter", "tokenizer", "engine", "gateway")}
    procs = {
        "meter": ServiceProcess("services.meter", ["--port", str(ports["meter"]),
                                                   "--metrics-port", "-1",
                                                   "--db", str(tmp / "meter.db")],
                                ports["meter"], log_path=tmp / "meter.log"),
        "tokenizer": ServiceProcess("services.tokenizer", [
            "--port", str(ports["tokenizer"]), "--metrics-port", "-1",
            "--model", f"{DEFAULT_MODEL_NAME}={model}"], ports["tokenizer"],
            log_path=tmp / "tokenizer.log"),
        "engine": ServiceProcess("services.engine", [
            "--port", str(ports["engine"]), "--metrics-port", "-1", "--model-path", model,
            "--model-name", DEFAULT_MODEL_NAME, "--version", DEFAULT_MODEL_VERSION,
            "--etcd-endpoints", etcd_session.endpoint], ports["engine"],
            log_path=tmp / "engine.log"),
        "gateway": ServiceProcess("services.gateway", [
            "--port", str(ports["gateway"]), "--metrics-port", "-1", "--http-port", "-1",
            "--etcd-endpoints", etcd_session.endpoint,
            "--tokenizer", f"127.0.0.1:{ports['tokenizer']}",
            "--meter", f"127.0.0.1:{ports['meter']}",
            "--snapshot", str(tmp / "gw.json"), "--spool", str(tmp / "spool.db")],
            ports["gateway"], log_path=tmp / "gateway.log"),
    }
    started = []
    try:
        for name, proc in procs.items():
            proc.start(timeout=600)
            started.append(proc)
        yield procs, key
    finally:
        for proc in reversed(started):
            proc.stop()


def test_chat_usage_matches_the_tokens_streamed(suite):
    procs, key = suite
    with Client(procs["gateway"].target, key, timeout=120) as c:
        # The engine registers after SERVING; the gateway routes once it sees the registration.
        assert wait_for(lambda: c.list_models()[0].name == DEFAULT_MODEL_NAME)
        chunks = list(c.chat([{"role": "user", "content": "What is the capital of France?"}],
                             max_tokens=16))
        expected_prompt = c.count_tokens(
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    last = chunks[-1]
    ids = [t for ch in chunks for t in ch.token_ids]
    assert last.finish_reason in ("stop", "length")
    assert last.usage.completion_tokens == len(ids) > 0
    assert last.usage.prompt_tokens == expected_prompt > 10
    assert last.model_version == DEFAULT_MODEL_VERSION
    assert "Paris" in "".join(ch.text for ch in chunks)


def test_generate_prompt_is_tokenized_by_the_tokenizer_service(suite):
    procs, key = suite
    with grpc.insecure_channel(procs["tokenizer"].target) as ch:
        n = tokenizer_pb2_grpc.TokenizerServiceStub(ch).Encode(tokenizer_pb2.EncodeRequest(
            model=DEFAULT_MODEL_NAME, text="The quick brown fox", add_special_tokens=True),
            timeout=30)
    with Client(procs["gateway"].target, key, timeout=120) as c:
        text, usage = c.generate_text("The quick brown fox", max_tokens=4)
    assert usage.prompt_tokens == len(n.token_ids) > 0
    assert 1 <= usage.completion_tokens <= 4 and text


def test_cancelled_stream_frees_the_engine(suite):
    procs, key = suite
    with Client(procs["gateway"].target, key, timeout=120) as c:
        stream = c.generate("Count to one hundred: 1, 2, 3,", max_tokens=64)
        next(stream)
        stream.close()
    with grpc.insecure_channel(procs["engine"].target) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)

        def idle():
            info = stub.GetInfo(engine_pb2.GetInfoRequest(), timeout=10)
            return info.running == 0 and info.waiting == 0
        assert wait_for(idle)
