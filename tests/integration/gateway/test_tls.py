"""The real gateway process over mutual TLS: to its callers (gRPC and HTTPS), to the FAKE
tokenizer and engine (which demand client certificates) and to an etcd that demands them too;
and a gateway logging in to etcd with a user and the password from its environment.
Certificates are made here (controlplane.certs, openssl)."""
from __future__ import annotations

import os
import json
import shutil
import ssl
import urllib.error
import urllib.request

import grpc
import pytest

from controlplane.certs import issue, make_ca
from controlplane.etcd_client import EtcdOptions
from controlplane.etcd_local import EtcdProcess, ServerTls
from controlplane.service_process import ServiceProcess
from tests.integration.controlplane.test_auth import enable_auth
from tests.integration.gateway.conftest import Control, start_gateway
from tests.integration.gateway.fakes import MODEL, fake_engine, fake_tokenizer
from tokenserve.client import Client
from tokenserve.runtime.ports import free_port
from tokenserve.runtime.tls import TlsConfig

pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None and os.environ.get("CI") != "true", reason="needs the openssl CLI")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    ca = make_ca(d)
    return {"server": issue(ca, d, "server"), "client": issue(ca, d, "client"),
            "stranger": issue(make_ca(d / "other"), d / "other", "stranger")}


@pytest.fixture(scope="module")
def mtls(certs):
    s = certs["server"]
    return TlsConfig(str(s.cert), str(s.key), str(s.ca), "require")


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory, certs):
    s = certs["server"]
    proc = EtcdProcess(tmp_path_factory.mktemp("etcd") / "data", free_port(), free_port(),
                       unsafe_no_fsync=True,
                       tls=ServerTls(str(s.cert), str(s.key), str(s.ca), client_cert_auth=True))
    proc.start()
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, certs, mtls, tls_etcd):
    s, c = certs["server"], certs["client"]
    control = Control(tls_etcd.endpoint, EtcdOptions(
        [tls_etcd.endpoint], ca_file=str(c.ca), cert_file=str(c.cert), key_file=str(c.key)))
    control.seed()
    key = control.issue_key("acme")
    tokenizer, engine = fake_tokenizer(mtls), fake_engine(mtls, delay=0.01)
    tmp = tmp_path_factory.mktemp("gateway-tls")
    flags = ["--tls-cert", str(s.cert), "--tls-key", str(s.key), "--tls-ca", str(s.ca),
             "--tls-client-auth", "require", "--etcd-ca", str(s.ca), "--etcd-cert", str(s.cert),
             "--etcd-key", str(s.key)]
    gw = start_gateway(tmp, tls_etcd.endpoint, tokenizer.target, f"127.0.0.1:{free_port()}",
                       [engine.target], extra_args=flags,
                       tls=TlsConfig(str(c.cert), str(c.key), str(c.ca)))
    yield gw, key
    gw.stop()
    tokenizer.stop()
    engine.stop()


def test_a_client_with_the_ca_and_a_certificate_is_served_end_to_end(gateway, certs):
    gw, key = gateway
    c = certs["client"]
    # the key is looked up in etcd (mutual TLS), the prompt goes to the fake tokenizer and
    # engine (mutual TLS): text back means every hop spoke TLS with certificates
    with Client(gw.target, key, timeout=20, tls_ca=str(c.ca), tls_cert=str(c.cert),
                tls_key=str(c.key)) as client:
        text, usage = client.chat_text([{"role": "user", "content": "hello"}], max_tokens=2)
    assert text == "w0 w1 " and usage.completion_tokens == 2


@pytest.mark.parametrize("who", ["plaintext", "no client certificate", "another CA's certificate"])
def test_callers_without_tls_or_a_good_certificate_are_refused(gateway, certs, who):
    gw, key = gateway
    c, x = certs["client"], certs["stranger"]
    kw = {"plaintext": {}, "no client certificate": {"tls_ca": str(c.ca)},
          "another CA's certificate": {"tls_ca": str(c.ca), "tls_cert": str(x.cert),
                                       "tls_key": str(x.key)}}[who]
    with Client(gw.target, key, timeout=10, **kw) as client:
        with pytest.raises(Exception) as err:
            client.list_models()
    assert getattr(err.value, "code", None) == grpc.StatusCode.UNAVAILABLE, err.value


def test_the_http_front_serves_https_with_the_same_certificate(gateway, certs):
    gw, key = gateway
    c = certs["client"]
    url = f"https://127.0.0.1:{gw.http_port}/v1/models"
    request = urllib.request.Request(url, headers={"authorization": f"Bearer {key}"})
    ctx = ssl.create_default_context(cafile=str(c.ca))
    ctx.load_cert_chain(str(c.cert), str(c.key))
    with urllib.request.urlopen(request, timeout=10, context=ctx) as r:
        assert MODEL in [m["id"] for m in json.loads(r.read())["data"]]
    no_cert = ssl.create_default_context(cafile=str(c.ca))
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(request, timeout=10, context=no_cert).read()
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):  # plaintext HTTP
        urllib.request.urlopen(url.replace("https", "http"), timeout=10).read()


def test_a_gateway_without_etcd_client_certificate_fails_readably(tmp_path, tls_etcd, certs):
    s = certs["server"]
    port = free_port()
    args = ["--port", str(port), "--metrics-port", "-1", "--http-port", "-1",
            "--etcd-endpoints", tls_etcd.endpoint, "--snapshot", str(tmp_path / "none.json"),
            "--spool", str(tmp_path / "spool.db"), "--etcd-ca", str(s.ca)]  # CA, no certificate
    proc = ServiceProcess("services.gateway", args, port, log_path=tmp_path / "gw.log").spawn()
    assert proc.proc.wait(60) == 1
    log = proc.tail()
    assert "gateway_start_failed" in log and tls_etcd.endpoint in log, log


def test_a_gateway_logs_in_to_etcd_with_the_password_from_its_environment(tmp_path, etcd):
    enable_auth(etcd.endpoint, "s3cret")
    control = Control(etcd.endpoint, EtcdOptions([etcd.endpoint], user="root", password="s3cret"))
    control.seed()
    key = control.issue_key("acme")
    tokenizer, engine = fake_tokenizer(), fake_engine()
    try:
        gw = start_gateway(tmp_path, etcd.endpoint, tokenizer.target, f"127.0.0.1:{free_port()}",
                           [engine.target], extra_args=["--etcd-user", "root"],
                           env={"TOKENSERVE_ETCD_PASSWORD": "s3cret"})
        try:
            with Client(gw.target, key, timeout=20) as client:
                assert client.generate_text("a b", max_tokens=2)[0] == "w0 w1 "
            assert "s3cret" not in gw.proc.tail(1000)
        finally:
            gw.stop()
        # the wrong password: no start, and the log says why
        port = free_port()
        proc = ServiceProcess("services.gateway", [
            "--port", str(port), "--metrics-port", "-1", "--http-port", "-1",
            "--etcd-endpoints", etcd.endpoint, "--snapshot", str(tmp_path / "none.json"),
            "--spool", str(tmp_path / "spool2.db"), "--etcd-user", "root"], port,
            log_path=tmp_path / "gw2.log", env={"TOKENSERVE_ETCD_PASSWORD": "n0t-the-Pa55"}).spawn()
        assert proc.proc.wait(60) == 1
        assert "refused the credentials" in proc.tail(), proc.tail()
        assert "n0t-the-Pa55" not in proc.tail()
    finally:
        tokenizer.stop()
        engine.stop()
