"""TLS flags and a GrpcServer over TLS and mutual TLS (real loopback gRPC, certificates made
here by controlplane.certs with openssl)."""
from __future__ import annotations

import os
import asyncio
import shutil

import grpc
import pytest

from controlplane.certs import issue, make_ca
from controlplane.etcd_client import EtcdCredentials
from services.engine.main import parse_args as engine_args
from services.gateway.main import parse_args as gateway_args
from services.meter.main import parse_args as meter_args
from services.tokenizer.main import parse_args as tokenizer_args
from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tokenserve.runtime import health_probe
from tokenserve.runtime.channels import aio_channel
from tokenserve.runtime.server import GrpcServer, Registration, ServerOptions
from tokenserve.runtime.tls import PLAINTEXT, TlsConfig

pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None and os.environ.get("CI") != "true", reason="needs the openssl CLI")
SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    ca = make_ca(d)
    other_ca = make_ca(d / "other", "ca")
    return {"ca": ca, "server": issue(ca, d, "server"), "client": issue(ca, d, "client"),
            "stranger": issue(other_ca, d / "other", "stranger")}


def test_tls_flags_must_fit_together(certs):
    s = certs["server"]
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        TlsConfig(cert_file=str(s.cert))
    with pytest.raises(ValueError, match="require needs"):
        TlsConfig(cert_file=str(s.cert), key_file=str(s.key), client_auth="require")
    with pytest.raises(ValueError, match="no such file"):
        TlsConfig(ca_file="/nonexistent/ca.pem")
    with pytest.raises(ValueError, match="--tls-client-auth"):
        TlsConfig(client_auth="optional")
    assert not PLAINTEXT.serves_tls and not PLAINTEXT.dials_tls
    assert PLAINTEXT.channel_credentials() is None and PLAINTEXT.uvicorn_kwargs() == {}


def _flags(c) -> list[str]:
    return ["--tls-cert", str(c.cert), "--tls-key", str(c.key), "--tls-ca", str(c.ca),
            "--tls-client-auth", "require", "--etcd-ca", str(c.ca), "--etcd-cert", str(c.cert),
            "--etcd-key", str(c.key), "--etcd-user", "svc"]


@pytest.mark.parametrize("parse,extra", [(gateway_args, []), (meter_args, []),
                                         (tokenizer_args, ["--model", "m=/tmp"]),
                                         (engine_args, ["--model-path", "/tmp"])])
def test_every_service_takes_the_same_tls_and_etcd_flags(certs, monkeypatch, parse, extra):
    monkeypatch.setenv("TOKENSERVE_ETCD_PASSWORD", "s3cret")
    c = certs["server"]
    config = parse(_flags(c) + extra)
    assert config.tls == TlsConfig(str(c.cert), str(c.key), str(c.ca), "require")
    assert config.etcd_credentials == EtcdCredentials("svc", "s3cret", str(c.ca), str(c.cert),
                                                      str(c.key))
    assert "s3cret" not in repr(config)  # the password is never printed with the config
    options = config.etcd_credentials.options(["127.0.0.1:2379"])
    assert (options.user, options.password, options.ca_file) == ("svc", "s3cret", str(c.ca))
    assert parse(extra).tls == PLAINTEXT  # no flag: plaintext, as before


def test_an_etcd_user_without_the_password_variable_is_a_readable_usage_error(capsys, monkeypatch):
    monkeypatch.delenv("TOKENSERVE_ETCD_PASSWORD", raising=False)
    with pytest.raises(SystemExit):
        gateway_args(["--etcd-user", "svc"])
    assert "$TOKENSERVE_ETCD_PASSWORD" in capsys.readouterr().err


class Info(engine_pb2_grpc.EngineServiceServicer):
    async def GetInfo(self, request, context):
        return engine_pb2.GetInfoResponse(model="m")


async def _server(tls: TlsConfig) -> GrpcServer:
    srv = GrpcServer("test", [Registration(SERVICE, engine_pb2_grpc.add_EngineServiceServicer_to_server,
                                           Info())],
                     ServerOptions(port=0, drain_seconds=0, grace_seconds=0, tls=tls))
    await srv.start()
    return srv


async def _get_info(port: int, tls: TlsConfig | None) -> str:
    target = f"127.0.0.1:{port}"
    channel = aio_channel(target, tls=tls) if tls is not None else aio_channel(target)
    async with channel:
        try:
            r = await engine_pb2_grpc.EngineServiceStub(channel).GetInfo(
                engine_pb2.GetInfoRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code().name
    return r.model


async def test_mutual_tls_server_refuses_plaintext_and_callers_without_a_good_certificate(certs):
    s, c, x = certs["server"], certs["client"], certs["stranger"]
    srv = await _server(TlsConfig(str(s.cert), str(s.key), str(s.ca), "require"))
    try:
        ok = TlsConfig(str(c.cert), str(c.key), str(c.ca))
        assert await _get_info(srv.port, ok) == "m"
        assert await _get_info(srv.port, PLAINTEXT) == "UNAVAILABLE"  # plaintext: refused
        # TLS with the right CA but no client certificate: the handshake is refused
        assert await _get_info(srv.port, TlsConfig(ca_file=str(c.ca))) == "UNAVAILABLE"
        # a client certificate from another CA
        assert await _get_info(srv.port, TlsConfig(str(x.cert), str(x.key), str(c.ca))) == "UNAVAILABLE"
        # the health probe (the container check) with the same flags; blocking: off the loop
        address = f"127.0.0.1:{srv.port}"
        assert await asyncio.to_thread(health_probe.check, address, tls=ok) == "SERVING"
        assert await asyncio.to_thread(health_probe.check, address) == "UNAVAILABLE"
        assert await asyncio.to_thread(health_probe.main, [
            address, "--tls-ca", str(c.ca), "--tls-cert", str(c.cert), "--tls-key", str(c.key)]) == 0
    finally:
        await srv.stop()


async def test_tls_server_without_client_auth_takes_any_tls_caller_that_trusts_it(certs):
    s, c, x = certs["server"], certs["client"], certs["stranger"]
    srv = await _server(TlsConfig(str(s.cert), str(s.key)))
    try:
        assert await _get_info(srv.port, TlsConfig(ca_file=str(c.ca))) == "m"
        assert await _get_info(srv.port, PLAINTEXT) == "UNAVAILABLE"
        # a client that trusts another CA does not accept this server's certificate
        assert await _get_info(srv.port, TlsConfig(ca_file=str(x.ca))) == "UNAVAILABLE"
    finally:
        await srv.stop()
