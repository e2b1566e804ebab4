"""The real gateway process with a real etcd and a real meter, and FAKE tokenizer and engine
servers: auth, validation, routing, cancellation and usage, none of which needs a model."""
from __future__ import annotations

import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from controlplane.schema import Tenant
from controlplane.service_process import ServiceProcess
from tokenserve.runtime.ports import free_port
from tests.integration.gateway.conftest import FREE_MAX_TOKENS, start_gateway
from tests.integration.gateway.fakes import MODEL, fake_engine
from tokenserve.common.v1 import common_pb2
from tokenserve.gateway.v1 import gateway_pb2 as pb
from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc


def auth(key):
    return (("authorization", f"Bearer {key}"),)


def wait_for(predicate, timeout=10.0):
    """Polls until predicate() is truthy (config changes and usage arrive asynchronously)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return None


def meter_rows(meter_stub, request_id):
    csv = "".join(c.data for c in meter_stub.ExportCsv(meter_pb2.QueryUsageRequest(), timeout=5))
    header, *lines = csv.splitlines()
    cols = header.split(",")
    return [dict(zip(cols, ln.split(","))) for ln in lines if f",{request_id}," in ln]


def code_of(fn):
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


def test_generate_streams_tokens_and_ends_with_usage(gateway, key, engine, meter_stub):
    stub = gateway.stub()
    req = pb.GenerateRequest(prompt="one two three", max_tokens=5, request_id="gen-1",
                             temperature=0.5, app="bot")
    chunks = list(stub.Generate(req, metadata=auth(key), timeout=20))
    assert "".join(c.text for c in chunks) == "w0 w1 w2 w3 w4 "
    ids = [t for c in chunks for t in c.token_ids]
    last = chunks[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, len(ids)) == (3, 5)
    assert chunks[0].request_id == last.request_id == "gen-1"
    assert last.model_version == "v1"
    sent = next(r for r in engine.servicer.requests if r.request_id == "gen-1")
    assert (sent.tenant_id, sent.priority, sent.max_tokens) == ("acme", 0, 5)
    # Unset controls reach the engine as the shared defaults (tokenserve.sampling).
    assert (sent.sampling.temperature, sent.sampling.top_p) == (0.5, 1.0)
    (row,) = wait_for(lambda: meter_rows(meter_stub, "gen-1"))
    assert (row["source"], row["tenant_id"], row["tier"], row["app"], row["status"]) == (
        "gateway", "acme", "free", "bot", "OK")
    assert (row["prompt_tokens"], row["completion_tokens"], row["model_version"]) == ("3", "5", "v1")


def test_chat_is_templated_with_the_generation_prompt(gateway, key, tokenizer):
    stub = gateway.stub()
    req = pb.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content="hi there")],
                         max_tokens=2, request_id="chat-1")
    chunks = list(stub.Chat(req, metadata=auth(key), timeout=20))
    assert chunks[-1].usage.prompt_tokens == 2 + 2 + 1
    sent = [r for r in tokenizer.servicer.requests if r.WhichOneof("input") == "chat"][-1]
    assert sent.add_generation_prompt and sent.model == MODEL


def test_missing_and_wrong_keys_are_unauthenticated(gateway):
    stub = gateway.stub()
    req = pb.GenerateRequest(prompt="hi", max_tokens=1)
    code, details = code_of(lambda: list(stub.Generate(req, timeout=10)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert details == "missing authorization metadata: send 'authorization: Bearer ts-...'"
    code, _ = code_of(lambda: list(stub.Generate(req, metadata=auth("ts-nope"), timeout=10)))
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_live_key_changes_apply_without_restart(gateway, control):
    stub = gateway.stub()
    req = pb.GenerateRequest(prompt="hi", max_tokens=1)
    new_key = control.issue_key("acme")

    def outcome():
        try:
            list(stub.Generate(req, metadata=auth(new_key), timeout=10))
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()

    assert wait_for(lambda: outcome() == grpc.StatusCode.OK)
    control.revoke(new_key)
    assert wait_for(lambda: outcome() == grpc.StatusCode.UNAUTHENTICATED)


def test_disabled_tenant_is_permission_denied(gateway, control):
    control.put(Tenant("gone", "Gone Inc", "free"))
    gone_key = control.issue_key("gone")
    control.put(Tenant("gone", "Gone Inc", "free", enabled=False))
    stub = gateway.stub()

    def code():
        try:
            stub.ListModels(pb.ListModelsRequest(), metadata=auth(gone_key), timeout=10)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()

    assert wait_for(lambda: code() == grpc.StatusCode.PERMISSION_DENIED)


# Bad requests (every field, both adapters): tests/bad_input.py, run by test_bad_input.py.


def test_quota_headers_arrive_while_the_engine_still_works(gateway, key, engine):
    """The remaining-quota headers go out once the request is admitted, not with the first
    token: a client reads them while the engine has produced nothing yet."""
    engine.servicer.hold = hold = threading.Event()
    try:
        call = gateway.stub().Generate(pb.GenerateRequest(prompt="a b", max_tokens=2,
                                                          request_id="early-headers"),
                                       metadata=auth(key), timeout=30)
        # the engine holds its first token until `hold` is set, below
        with ThreadPoolExecutor(1) as pool:
            headers = dict(pool.submit(call.initial_metadata).result(timeout=15))
        assert int(headers["x-ratelimit-remaining-tokens"]) >= 0
        assert "x-ratelimit-limit-requests" in headers
    finally:
        hold.set()
        engine.servicer.hold = None
    chunks = list(call)
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_client_cancel_cancels_the_engine_call_and_is_metered(gateway, key, engine, meter_stub):
    stub = gateway.stub()
    engine.servicer.cancel_seen.clear()
    engine.servicer.delay = 0.5  # the fake must not finish all tokens before the cancel lands
    try:
        call = stub.Generate(pb.GenerateRequest(prompt="a b", max_tokens=FREE_MAX_TOKENS,
                                                request_id="cancel-1"),
                             metadata=auth(key), timeout=30)
        first = next(call)
        assert first.token_ids
        call.cancel()
        assert engine.servicer.cancel_seen.wait(10)
    finally:
        engine.servicer.delay = 0.05
    assert "cancel-1" in engine.servicer.cancelled
    (row,) = wait_for(lambda: meter_rows(meter_stub, "cancel-1"))
    assert row["status"] == "CANCELLED"
    assert 1 <= int(row["completion_tokens"]) < FREE_MAX_TOKENS


def test_an_engine_that_ends_a_request_at_its_deadline_is_deadline_exceeded(
        gateway, key, engine, meter_stub):
    # The engine stops a request whose deadline passed (finish reason cancelled) a moment
    # before the caller's own deadline fires: the caller must not see a short OK answer.
    stub = gateway.stub()
    engine.servicer.delay, engine.servicer.expire_within = 0.5, 1.5
    try:
        got, details = code_of(lambda: list(stub.Generate(
            pb.GenerateRequest(prompt="a", max_tokens=FREE_MAX_TOKENS, request_id="expired-1"),
            metadata=auth(key), timeout=3)))
    finally:
        engine.servicer.delay, engine.servicer.expire_within = 0.05, None
    assert got == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline" in details
    (row,) = wait_for(lambda: meter_rows(meter_stub, "expired-1"))
    assert row["status"] == "DEADLINE_EXCEEDED"
    assert 1 <= int(row["completion_tokens"]) < FREE_MAX_TOKENS


def test_deadline_cancels_the_engine_call_and_is_metered(gateway, key, engine, meter_stub):
    stub = gateway.stub()
    engine.servicer.cancel_seen.clear()
    engine.servicer.delay = 1.0  # 16 tokens would take 16 s; the caller allows 3
    try:
        got, _ = code_of(lambda: list(stub.Generate(
            pb.GenerateRequest(prompt="a", max_tokens=FREE_MAX_TOKENS, request_id="late-1"),
            metadata=auth(key), timeout=3)))
        assert got == grpc.StatusCode.DEADLINE_EXCEEDED
        assert engine.servicer.cancel_seen.wait(10)
    finally:
        engine.servicer.delay = 0.05
    assert "late-1" in engine.servicer.cancelled
    (row,) = wait_for(lambda: meter_rows(meter_stub, "late-1"))
    assert row["status"] in ("DEADLINE_EXCEEDED", "CANCELLED")


def test_a_deadline_that_leaves_no_time_for_the_engine_is_not_sent_or_billed(
        gateway, key, tokenizer, engine, meter_stub):
    # tokenizing takes 200 ms of the caller's 201-209: at most a few ms are left for the
    # engine call, less than MIN_ENGINE_CALL_S; gRPC could fail such a call before the
    # engine's handler runs, and the gateway would bill work it cannot know was done
    stub = gateway.stub()
    tokenizer.servicer.delay = 0.2
    try:
        for ms in range(1, 10):
            got, details = code_of(lambda: list(stub.Generate(
                pb.GenerateRequest(prompt="a", max_tokens=4, request_id=f"no-time-{ms}"),
                metadata=auth(key), timeout=0.2 + ms / 1000)))
            assert got == grpc.StatusCode.DEADLINE_EXCEEDED, details
    finally:
        tokenizer.servicer.delay = 0.0
    # a request with time to spare still goes through; its row comes after any of theirs
    list(stub.Generate(pb.GenerateRequest(prompt="a", max_tokens=2, request_id="in-time"),
                       metadata=auth(key), timeout=30))
    assert wait_for(lambda: meter_rows(meter_stub, "in-time"))
    sent = {r.request_id for r in engine.servicer.requests}
    assert not any(f"no-time-{ms}" in sent for ms in range(1, 10)), sent
    assert not any(meter_rows(meter_stub, f"no-time-{ms}") for ms in range(1, 10))


def test_count_tokens_and_list_models(gateway, key):
    stub = gateway.stub()
    assert stub.CountTokens(pb.CountTokensRequest(prompt="a b c"), metadata=auth(key),
                            timeout=10).count == 3
    chat = pb.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="a b")])
    assert stub.CountTokens(pb.CountTokensRequest(chat=chat), metadata=auth(key),
                            timeout=10).count == 5
    got, _ = code_of(lambda: stub.CountTokens(pb.CountTokensRequest(), metadata=auth(key),
                                              timeout=10))
    assert got == grpc.StatusCode.INVALID_ARGUMENT
    models = stub.ListModels(pb.ListModelsRequest(), metadata=auth(key), timeout=10).models
    by_name = {m.name: m for m in models}
    assert set(by_name) == {MODEL, "lonely"}
    assert [(v.version, v.weight) for v in by_name[MODEL].versions] == [("v1", 1)]
    assert by_name[MODEL].max_context == 64


def test_metrics_count_requests_by_tier_and_code(gateway, key):
    stub = gateway.stub()
    list(stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=1), metadata=auth(key),
                       timeout=10))
    text = urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics",
                                  timeout=5).read().decode()
    assert 'tokenserve_gateway_requests_total{code="OK",method="Generate",tier="free"}' in text
    assert "tokenserve_gateway_time_to_first_token_seconds_bucket" in text
    assert 'code="UNAUTHENTICATED"' in text


def test_unavailable_engine_before_the_first_token_is_retried_elsewhere(
        workdir, control, key, tokenizer, meter):
    # Both start idle and ties go to the lower endpoint: the one that sorts first fails.
    down, up = sorted([fake_engine(), fake_engine()], key=lambda s: s.target)
    down.servicer.fail_with = grpc.StatusCode.UNAVAILABLE
    gw = start_gateway(workdir, control.endpoint, tokenizer.target, meter.target,
                       [down.target, up.target], name="gateway-retry")
    try:
        chunks = list(gw.stub().Generate(pb.GenerateRequest(prompt="hi", max_tokens=3),
                                         metadata=auth(key), timeout=20))
        assert chunks[-1].usage.completion_tokens == 3
        assert len(down.servicer.requests) == 1 and len(up.servicer.requests) == 1
    finally:
        gw.stop()
        down.stop()
        up.stop()


def test_spooled_usage_survives_a_crash_and_reaches_the_meter_later(workdir, control, key,
                                                                   tokenizer, engine):
    late_port = free_port()
    late = ServiceProcess("services.meter", ["--port", str(late_port), "--metrics-port", "-1",
                                             "--db", str(workdir / "late-meter.db")],
                          late_port, log_path=workdir / "late-meter.log")
    args = (workdir, control.endpoint, tokenizer.target, f"127.0.0.1:{late_port}",
            [engine.target])
    gw = start_gateway(*args, name="gateway-spool")
    try:
        list(gw.stub().Generate(pb.GenerateRequest(prompt="hi", max_tokens=2,
                                                   request_id="spooled-1"),
                                metadata=auth(key), timeout=20))
        # The request completed while no meter listened; the gateway dies without a flush.
        gw.proc.kill()
        late.start()
        gw = start_gateway(*args, name="gateway-spool")  # same spool file
        with grpc.insecure_channel(late.target) as ch:
            late_stub = meter_pb2_grpc.MeterServiceStub(ch)
            (row,) = wait_for(lambda: meter_rows(late_stub, "spooled-1"), timeout=60)
        assert row["completion_tokens"] == "2" and row["status"] == "OK"
    finally:
        codes = (gw.stop(), late.stop())
    assert codes == (0, 0)


def test_gateway_refuses_to_start_without_etcd_or_a_snapshot(workdir, tokenizer, meter):
    port = free_port()
    proc = ServiceProcess("services.gateway", [
        "--port", str(port), "--metrics-port", "-1", "--http-port", "-1", "--etcd-endpoints",
        f"127.0.0.1:{free_port()}", "--tokenizer", tokenizer.target, "--meter", meter.target,
        "--snapshot", str(workdir / "never-written.json"), "--spool", str(workdir / "x.db")],
        port, log_path=workdir / "no-etcd.log")
    with pytest.raises(RuntimeError, match="exited with 1"):
        proc.start(timeout=60)
    assert "no last-known-good snapshot" in (workdir / "no-etcd.log").read_text()
