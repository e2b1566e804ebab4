"""`tokenserve up` as a user runs it (the real command, the whole suite as real processes on
ephemeral ports), then faults: a SIGKILLed meter or engine is restarted while the rest keeps
serving; SIGTERM stops everything.

Tests share one running suite and run in file order: the faults come last, the SIGTERM last
of all.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from controlplane.service_process import ROOT
from tests.bad_input import cases, gen, grpc_call, grpc_outcome, ids
from tokenserve.common.v1 import common_pb2
from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tokenserve.gateway.v1 import gateway_pb2 as pb
from tokenserve.gateway.v1 import gateway_pb2_grpc
from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc

pytestmark = pytest.mark.slow


def wait_for(predicate, timeout=30.0, interval=0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(interval)
    return None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Up:
    """The `tokenserve up` process: its output, its up.json, a client of its gateway."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.out_path = data_dir / "up.out"
        self.out = open(self.out_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "controlplane.launcher", "up", "--ephemeral-ports",
             "--data-dir", str(data_dir / "var")], cwd=ROOT, stdout=self.out,
            stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.key = ""
        self.channel: grpc.Channel | None = None

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_output(self, text: str, timeout: float) -> bool:
        def seen():
            if self.proc.poll() is not None and text not in self.output():
                raise AssertionError(f"tokenserve up exited ({self.proc.returncode}):\n"
                                     + self.output()[-3000:])
            return text in self.output()
        return bool(wait_for(seen, timeout, 0.2))

    def start(self):
        assert self.wait_output("Press Ctrl-C to stop.", 600), self.output()[-3000:]
        self.key = re.search(r"API key \(shown once\):\n  (ts-\S+)", self.output()).group(1)
        self.channel = grpc.insecure_channel(self.address("gateway"))
        self.api = gateway_pb2_grpc.InferenceServiceStub(self.channel)

    @property
    def state(self) -> dict:
        return json.loads((self.data_dir / "var" / "up.json").read_text())

    @property
    def meter_token(self) -> str:
        return (self.data_dir / "var" / "meter-token").read_text().strip()

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.state['ports'][name]}"

    @property
    def auth(self):
        return (("authorization", f"Bearer {self.key}"),)

    def generate(self, prompt="Hello", max_tokens=2, request_id="", timeout=60):
        return list(self.api.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens,
                                                         request_id=request_id),
                                      metadata=self.auth, timeout=timeout))

    def all_pids(self) -> list[int]:
        state = self.state
        return [*state["pids"].values(), state["etcd_pid"]]

    def stop(self):
        if self.channel is not None:
            self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.out.close()


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    u = Up(tmp_path_factory.mktemp("up"))
    try:
        u.start()
        yield u
    finally:
        u.stop()


def meter_rows(up: Up, request_ids: set[str]) -> set[tuple[str, str]]:
    """(request id, source) of the meter's rows (both sources) for request_ids."""
    csv = ""
    with grpc.insecure_channel(up.address("meter")) as ch:
        meter = meter_pb2_grpc.MeterServiceStub(ch)
        for source in (meter_pb2.SOURCE_GATEWAY, meter_pb2.SOURCE_ENGINE):
            try:
                csv += "".join(c.data for c in meter.ExportCsv(
                    meter_pb2.QueryUsageRequest(source=source), timeout=10,
                    metadata=(("authorization", f"Bearer {up.meter_token}"),)))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
                return set()
    fields = [line.split(",") for line in csv.splitlines()]
    return {(f[1], f[2]) for f in fields if f[1] in request_ids}


def engine_idle(up: Up) -> engine_pb2.GetInfoResponse | None:
    """The engine's GetInfo once nothing runs or waits and every KV block is free."""
    with grpc.insecure_channel(up.address("engine")) as ch:
        info = engine_pb2_grpc.EngineServiceStub(ch).GetInfo(engine_pb2.GetInfoRequest(),
                                                             timeout=10)
    idle = (info.running, info.waiting, info.kv_blocks_free) == (0, 0, info.kv_blocks_total)
    return info if idle else None


def http_stream_first_event(up: Up, case) -> bytes:
    """Sends the case's HTTP request with `stream: true`, reads the first event, leaves."""
    import http.client

    body = json.dumps({**case.request.http.body, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", up.state["ports"]["gateway_http"], timeout=60)
    try:
        conn.request("POST", "/v1" + case.request.http.path, body,
                     {"authorization": f"Bearer {up.key}", "content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        return resp.readline()
    finally:
        conn.close()  # the client goes away mid-stream


def http_gives_up_after(up: Up, case, seconds: float) -> None:
    import socket

    req = urllib.request.Request(f"http://127.0.0.1:{up.state['ports']['gateway_http']}/v1"
                                 + case.request.http.path, data=case.request.http.data(),
                                 headers={"authorization": f"Bearer {up.key}",
                                          "content-type": "application/json"})
    with pytest.raises((TimeoutError, socket.timeout, urllib.error.URLError)):
        urllib.request.urlopen(req, timeout=seconds).read()


@pytest.mark.parametrize("case", cases("suite"), ids=ids(cases("suite")))
def test_bad_input_that_needs_the_real_engine_frees_its_kv_blocks(up, case):
    auth = f"Bearer {up.key}"
    assert wait_for(lambda: engine_idle(up), 30), "the engine was busy before the case"
    if case.scenario == "deadline":
        started = time.monotonic()
        code, details = grpc_outcome(up.channel, case.request, auth, timeout=0.5)
        assert time.monotonic() - started < 5
    else:
        call = grpc_call(up.channel, case.request, auth, timeout=120)
        assert next(call)  # one token arrived
        call.cancel()
        try:
            list(call)
            code, details = "OK", ""
        except grpc.RpcError as e:
            code, details = e.code().name, e.details()
    assert code == case.code, details
    assert all(w in details for w in case.words), details
    info = wait_for(lambda: engine_idle(up), 10)
    assert info, "the engine still holds the request's KV blocks"

    # over HTTP the client leaves (there is no status to see): the engine call is cancelled
    assert case.http_status is None
    if case.scenario == "deadline":
        http_gives_up_after(up, case, 0.5)
    else:
        assert http_stream_first_event(up, case).startswith(b"data: ")
    assert wait_for(lambda: engine_idle(up), 10), "the HTTP call's KV blocks were not freed"


def test_the_meter_is_not_reachable_with_a_tenant_key_but_usage_is_through_the_gateway(up):
    with grpc.insecure_channel(up.address("meter")) as ch:
        meter = meter_pb2_grpc.MeterServiceStub(ch)
        for md in ((), up.auth):
            with pytest.raises(grpc.RpcError) as err:
                meter.QueryUsage(meter_pb2.QueryUsageRequest(), metadata=md, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    up.generate(request_id="own-usage")
    rows = wait_for(lambda: up.api.GetUsage(pb.GetUsageRequest(), metadata=up.auth,
                                            timeout=10).rows, 30)
    assert rows and rows[0].requests >= 1  # the gateway reads the meter with its token
    out = subprocess.run([sys.executable, "-m", "controlplane.tsctl", "usage", "--meter",
                          up.address("meter"), "--since", "1h", "--json"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "TOKENSERVE_METER_TOKEN": up.meter_token})
    assert out.returncode == 0, out.stderr
    assert "TOKENSERVE_METER_TOKEN=$(cat " in up.output()  # how to, printed at start
    assert (up.data_dir / "var" / "meter-token").stat().st_mode & 0o777 == 0o600


def etcd_text(up: Up) -> str:
    """Every key and value in etcd, one per line."""
    from aetcd import rpc

    with grpc.insecure_channel(up.address("etcd")) as ch:
        resp = rpc.KVStub(ch).Range(rpc.RangeRequest(key=b"\0", range_end=b"\0"), timeout=10)
    return "\n".join(f"{kv.key.decode(errors='replace')} {kv.value.decode(errors='replace')}"
                     for kv in resp.kvs)


def sqlite_text(db: Path) -> str:
    """Every value in every row of every table of a SQLite database."""
    import contextlib
    import sqlite3

    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return "\n".join(v.decode(errors="replace") if isinstance(v, bytes) else str(v)
                         for t in tables for row in conn.execute(f'SELECT * FROM "{t}"')
                         for v in row)


def everything_written(up: Up) -> dict[str, str]:
    """Where secrets could leak -> its text: every file under the data dir as raw bytes
    (logs, SQLite files and their WALs, config snapshots, etcd's own files), the rows of
    every SQLite database, etcd's keys and values through its API, and every /metrics."""
    found: dict[str, str] = {}
    var = up.data_dir / "var"
    for path in sorted(p for p in var.rglob("*") if p.is_file() and p.name != "meter-token"):
        found[str(path.relative_to(var))] = path.read_bytes().decode("latin-1")
        if path.suffix == ".db":
            found[f"{path.name} rows"] = sqlite_text(path)
    found["etcd keys and values"] = etcd_text(up)
    for service in ("gateway", "tokenizer", "engine", "meter"):
        port = up.state["ports"][f"{service}_metrics"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            found[f"{service} /metrics"] = r.read().decode()
    return found


def where(text: str, found: dict[str, str]) -> list[str]:
    return [name for name, content in found.items() if text in content]


def test_no_key_prompt_or_completion_in_anything_the_suite_wrote(up):
    import hashlib
    import uuid

    from controlplane.schema import hash_api_key

    marker = f"quokka{uuid.uuid4().hex[:12]}"
    prompt = f"Repeat this word three times: {marker}"
    tsctl = [sys.executable, "-m", "controlplane.tsctl", "--endpoints", up.address("etcd")]
    out = subprocess.run([*tsctl, "--json", "key", "issue", "demo"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    second_key = json.loads(out.stdout)["key"]
    keys = [up.key, second_key]

    completions = []
    chunks = up.generate(prompt, max_tokens=24, request_id="scan-grpc")
    completions.append("".join(c.text for c in chunks))
    chat = up.api.Chat(pb.ChatRequest(messages=[
        common_pb2.ChatMessage(role="user", content=prompt)], max_tokens=24),
        metadata=(("authorization", f"Bearer {second_key}"),), timeout=60)
    completions.append("".join(c.text for c in chat))
    req = urllib.request.Request(
        f"http://127.0.0.1:{up.state['ports']['gateway_http']}/v1/chat/completions",
        data=json.dumps({"messages": [{"role": "user", "content": prompt}],
                         "max_tokens": 24}).encode(),
        headers={"authorization": f"Bearer {up.key}", "content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        completions.append(json.loads(r.read())["choices"][0]["message"]["content"])
    # a refused request too: its text must not be quoted in the error log either
    assert grpc_outcome(up.channel, gen(prompt + "\x00"), f"Bearer {up.key}")[0] == \
        "INVALID_ARGUMENT"
    out = subprocess.run([*tsctl, "key", "revoke", second_key[:10]], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    completions = [c.strip() for c in completions if len(c.strip()) >= 12]
    assert completions, "no completion long enough to search for"
    # the usage of these requests is in the meter before the scan
    assert wait_for(lambda: meter_rows(up, {"scan-grpc"}) == {("scan-grpc", "gateway"),
                                                              ("scan-grpc", "engine")}, 30)

    found = everything_written(up)
    assert "meter.db rows" in found and "gateway-spool.db rows" in found
    assert "engine-spool.db rows" in found and "logs/gateway.log" in found
    for key in keys:
        assert where(key, found) == [], f"an API key is stored in {where(key, found)}"
        assert where(key[10:30], found) == [], "part of an API key beyond its display prefix"
        # what is kept instead: the hash (etcd) and the display prefix
        assert where(hash_api_key(key), found)
        assert where(key[:10], found)
    assert where(up.meter_token, found) == [], "the meter's token is stored elsewhere"
    assert where(marker, found) == [], f"the prompt is stored in {where(marker, found)}"
    for text in completions:
        assert where(text, found) == [], f"a completion is stored in {where(text, found)}"
    assert where(hashlib.sha256(marker.encode()).hexdigest(), found) == []

    # the scan does find what is there: a log line and an etcd value holding them
    from aetcd import rpc

    planted = up.data_dir / "var" / "logs" / "planted.log"
    planted.write_text(f"{marker} {completions[0]}\n")
    with grpc.insecure_channel(up.address("etcd")) as ch:
        kv = rpc.KVStub(ch)
        kv.Put(rpc.PutRequest(key=b"/planted", value=up.key.encode()), timeout=10)
        try:
            found = everything_written(up)
            assert where(marker, found) == where(completions[0], found) == ["logs/planted.log"]
            assert "etcd keys and values" in where(up.key, found)
        finally:
            planted.unlink()
            kv.DeleteRange(rpc.DeleteRangeRequest(key=b"/planted"), timeout=10)


def metric(up: Up, service: str, name: str) -> float:
    port = up.state["ports"][f"{service}_metrics"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in {service}'s /metrics")


def test_a_killed_meter_is_restarted_and_the_usage_spooled_meanwhile_arrives(up):
    up.generate()  # warm: the first request of a fresh engine is slower
    meter_pid = up.state["pids"]["meter"]
    # The launcher is paused while the meter is down, so that the outage outlasts the
    # requests whatever the machine's speed; it notices the exit once resumed.
    up.proc.send_signal(signal.SIGSTOP)
    try:
        os.kill(meter_pid, signal.SIGKILL)
        served_while_down = [f"meter-down-{i}" for i in range(3)]
        for rid in served_while_down:
            chunks = up.generate(request_id=rid)
            assert chunks[-1].usage.completion_tokens > 0
        spooled = {s: metric(up, s, f"tokenserve_{s}_usage_spool_events")
                   for s in ("gateway", "engine")}
        assert spooled["gateway"] >= 3 and spooled["engine"] >= 3, spooled
    finally:
        up.proc.send_signal(signal.SIGCONT)
    assert up.wait_output("meter is serving again", 60), up.output()[-2000:]
    assert "meter exited with code -9; restart 1 in 0.5 s" in up.output()
    assert up.state["restarts"] == {"meter": 1}
    assert up.state["pids"]["meter"] != meter_pid
    wanted = {(rid, src) for rid in served_while_down for src in ("gateway", "engine")}
    assert wait_for(lambda: meter_rows(up, set(served_while_down)) >= wanted, 60), (
        "usage spooled while the meter was down never reached it")
    assert wait_for(lambda: all(metric(up, s, f"tokenserve_{s}_usage_spool_events") == 0
                                for s in ("gateway", "engine")), 30)


def test_a_killed_engine_is_unavailable_until_restarted_then_serves(up):
    engine_pid = up.state["pids"]["engine"]
    killed = time.monotonic()
    os.kill(engine_pid, signal.SIGKILL)
    codes = set()
    while "engine is serving again" not in up.output():
        try:
            up.generate(timeout=30)
            codes.add("OK")
        except grpc.RpcError as e:
            codes.add(e.code().name)
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            assert "engine" in e.details()
        assert time.monotonic() - killed < 300, up.output()[-2000:]
        time.sleep(0.2)
    assert "UNAVAILABLE" in codes
    assert "engine exited with code -9; restart 1 in 0.5 s" in up.output()

    def served():
        try:
            return up.generate(timeout=30)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            return None
    assert wait_for(served, 30), "the restarted engine never served"
    print(f"engine back and serving {time.monotonic() - killed:.1f} s after SIGKILL")
    assert up.state["restarts"] == {"meter": 1, "engine": 1}


def test_sigterm_stops_everything_and_leaves_nothing_running(up):
    pids = up.all_pids()
    assert all(alive(p) for p in pids)
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(120) == 0
    assert "stopped: gateway=0, engine=0, tokenizer=0, meter=0" in up.output()
    assert [p for p in pids if alive(p)] == []
