"""Driving `tokenserve up` from a test: the real command as a subprocess (its output in a
file, its ports and pids from up.json), clients of its services, and what it wrote to disk,
etcd and /metrics, for tests/e2e/test_tokenserve_up.py."""
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
from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tokenserve.gateway.v1 import gateway_pb2 as pb
from tokenserve.gateway.v1 import gateway_pb2_grpc
from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc


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

    def __init__(self, data_dir: Path, extra_args: tuple[str, ...] = ()):
        self.data_dir = data_dir
        self.out_path = data_dir / "up.out"
        self.out = open(self.out_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "controlplane.launcher", "up", "--ephemeral-ports",
             "--data-dir", str(data_dir / "var"), *extra_args], cwd=ROOT, stdout=self.out,
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

    def wait_output_count(self, text: str, count: int, timeout: float) -> bool:
        """Whether `text` appears at least `count` times in the output within `timeout` s."""
        return bool(wait_for(lambda: self.output().count(text) >= count, timeout, 0.2))

    def start(self):
        assert self.wait_output("Press Ctrl-C to stop.", 600), self.output()[-3000:]
        self.key = re.search(r"API key \(shown once\):\n  (ts-\S+)", self.output()).group(1)
        tls = self.state.get("tls")
        self.channel = (grpc.insecure_channel(self.address("gateway")) if not tls else
                        grpc.secure_channel(self.address("gateway"), grpc.ssl_channel_credentials(
                            Path(tls["ca"]).read_bytes())))
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

def metric(up: Up, service: str, name: str) -> float:
    port = up.state["ports"][f"{service}_metrics"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in {service}'s /metrics")

def gateway_usage(up: Up, request_ids: set[str]) -> dict[str, dict[str, str]]:
    """The gateway's usage rows in the meter for request_ids, by request id."""
    with grpc.insecure_channel(up.address("meter")) as ch:
        csv = "".join(c.data for c in meter_pb2_grpc.MeterServiceStub(ch).ExportCsv(
            meter_pb2.QueryUsageRequest(source=meter_pb2.SOURCE_GATEWAY), timeout=10,
            metadata=(("authorization", f"Bearer {up.meter_token}"),)))
    header, *lines = csv.splitlines()
    rows = [dict(zip(header.split(","), line.split(","))) for line in lines]
    return {r["request_id"]: r for r in rows if r["request_id"] in request_ids}

def registered_engines(up: Up) -> list[str]:
    return [line for line in etcd_text(up).splitlines()
            if line.startswith("/tokenserve/v1/engines/")]
