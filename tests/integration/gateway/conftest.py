"""A real etcd, a real meter process and a real gateway process, with FAKE tokenizer and
engine servers (see fakes.py) standing in for the model services."""
from __future__ import annotations

import asyncio
import dataclasses
from controlplane.service_process import ServiceProcess
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from controlplane.schema import (ModelSpec, ModelVersion, Route, Tenant, Tier,
                                 generate_api_key, hash_api_key)
from controlplane.store import ConfigStore
from tokenserve.runtime.ports import free_port
from tests.etcd_fixture import etcd, etcd_session  # noqa: F401  (pytest fixtures)
from tests.integration.gateway.fakes import MODEL, fake_engine, fake_tokenizer
from tokenserve.gateway.v1 import gateway_pb2_grpc
from tokenserve.meter.v1 import meter_pb2_grpc

FREE_MAX_TOKENS = 16


class Control:
    """Writes policy into the real etcd the gateway watches."""

    def __init__(self, endpoint: str, options=None):
        self.endpoint = endpoint
        self.options = options  # EtcdOptions with credentials (default: plaintext, none)

    def _run(self, fn):
        async def go():
            async with ConfigStore(self.options or [self.endpoint]) as store:
                return await fn(store)
        return asyncio.run(go())

    def put(self, *docs):
        async def write(store):
            for d in docs:
                await store.put(d, actor="test")
        self._run(write)

    def issue_key(self, tenant: str = "acme") -> str:
        key, record = generate_api_key(tenant)
        self.put(record)
        return key

    def revoke(self, key: str):
        async def revoke(store):
            cur = await store.require(f"keys/{hash_api_key(key)}")
            await store.put(dataclasses.replace(cur.document, revoked=True), actor="test")
        self._run(revoke)

    def seed(self):
        self.put(Tier("free", 50, 100_000, 1_000_000, 8, 0, FREE_MAX_TOKENS),
                 Tier("premium", 200, 400_000, 20_000_000, 64, 2, 32),
                 Tenant("acme", "Acme", "free"), Tenant("vip", "VIP", "premium"),
                 ModelSpec(MODEL, {"v1": ModelVersion("builtin:tiny", 64)}, "v1"),
                 Route(MODEL, {"v1": 1}),
                 ModelSpec("lonely", {"v1": ModelVersion("builtin:lonely", 64)}, "v1"),
                 Route("lonely", {"v1": 1}))


@dataclass
class Gateway:
    proc: ServiceProcess
    metrics_port: int
    spool: Path
    http_port: int
    channels: list = field(default_factory=list)

    @property
    def target(self) -> str:
        return self.proc.target

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL (what `openai.OpenAI(base_url=...)` takes)."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    def stub(self) -> gateway_pb2_grpc.InferenceServiceStub:
        ch = grpc.insecure_channel(self.target)
        self.channels.append(ch)
        return gateway_pb2_grpc.InferenceServiceStub(ch)

    def stop(self):
        for ch in self.channels:
            ch.close()
        return self.proc.stop()


def start_gateway(tmp: Path, etcd_endpoint: str, tokenizer: str, meter: str,
                  engines: list[str], name: str = "gateway", extra_args=(), *, env=None,
                  tls=None) -> Gateway:
    port, metrics_port, http_port = free_port(), free_port(), free_port()
    args = ["--port", str(port), "--metrics-port", str(metrics_port), "--http-port", str(http_port),
            "--etcd-endpoints", etcd_endpoint, "--tokenizer", tokenizer, "--meter", meter,
            "--snapshot", str(tmp / f"{name}-config.json"), "--spool", str(tmp / f"{name}.db"),
            "--default-model", MODEL, "--request-timeout", "20"]
    for e in engines:
        args += ["--engine", f"{MODEL}=v1={e}"]
    args += list(extra_args)
    proc = ServiceProcess("services.gateway", args, port, log_path=tmp / f"{name}.log", env=env,
                          **({"tls": tls} if tls is not None else {})).start()
    return Gateway(proc, metrics_port, tmp / f"{name}.db", http_port)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="module")
def control(etcd_session) -> Control:
    etcd_session.clear()
    c = Control(etcd_session.endpoint)
    c.seed()
    return c


@pytest.fixture(scope="module")
def meter(workdir):
    port = free_port()
    proc = ServiceProcess("services.meter", ["--port", str(port), "--metrics-port", "-1",
                                             "--db", str(workdir / "meter.db")],
                          port, log_path=workdir / "meter.log").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def meter_stub(meter):
    with grpc.insecure_channel(meter.target) as ch:
        yield meter_pb2_grpc.MeterServiceStub(ch)


@pytest.fixture(scope="module")
def tokenizer():
    server = fake_tokenizer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def engine():
    server = fake_engine(delay=0.05)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(workdir, control, key, tokenizer, engine, meter):
    gw = start_gateway(workdir, control.endpoint, tokenizer.target, meter.target,
                       [engine.target])
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def key(control) -> str:
    return control.issue_key("acme")
