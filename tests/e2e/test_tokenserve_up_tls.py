"""`tokenserve up --tls`: the whole suite over TLS (etcd and the internal services demanding
client certificates), driven with the commands it prints (grpcurl with -cacert, curl with
--cacert over HTTPS), the SDK with tls_ca, and plaintext callers refused."""
from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys

import grpc
import pytest
from aetcd import rpc

from controlplane import top
from controlplane.service_process import ROOT
from tests.e2e.up_process import Up, wait_for
from tokenserve.client import Client
from tokenserve.runtime import health_probe
from tokenserve.runtime.tls import TlsConfig

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("openssl") is None and os.environ.get("CI") != "true", reason="needs openssl")]


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    u = Up(tmp_path_factory.mktemp("up-tls"), ("--tls",))
    try:
        u.start()
        yield u
    finally:
        u.stop()


def printed(up: Up, heading: str) -> list[str]:
    """The command printed on the line after `heading` (or on it, after the heading)."""
    lines = up.output().splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rest = lines[i][len(heading):].strip()
    return shlex.split(rest or lines[i + 1].strip())


def test_the_printed_grpcurl_and_curl_commands_work_over_tls(up):
    grpcurl = printed(up, "Try it:")
    assert "-cacert" in grpcurl and "-plaintext" not in grpcurl
    r = subprocess.run(grpcurl, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout or '"text"' in r.stdout
    curl = shlex.split(next(line for line in up.output().splitlines()
                            if line.strip().startswith("curl ")))
    assert "--cacert" in curl and any(a.startswith("https://") for a in curl)
    r = subprocess.run(curl, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert '"choices"' in r.stdout
    # plaintext HTTP against the HTTPS port: no answer
    url = next(a for a in curl if a.startswith("https://"))
    r = subprocess.run(["curl", "-sS", "-m", "10", url.replace("https://", "http://")],
                       capture_output=True, text=True, timeout=30)
    assert '"choices"' not in r.stdout


def test_the_sdk_with_the_ca_is_served_and_a_plaintext_client_is_refused(up):
    ca = up.state["tls"]["ca"]
    with Client(up.address("gateway"), up.key, timeout=120, tls_ca=ca) as c:
        text, usage = c.chat_text([{"role": "user", "content": "Say hi"}], max_tokens=4)
        assert usage.completion_tokens >= 1
    with Client(up.address("gateway"), up.key, timeout=10) as plain:
        with pytest.raises(Exception) as err:
            plain.chat_text([{"role": "user", "content": "Say hi"}], max_tokens=4)
    assert "UNAVAILABLE" in str(err.value) or "unavailable" in str(err.value).lower()


def test_internal_services_and_etcd_demand_a_client_certificate(up):
    tls = up.state["tls"]
    with_cert = TlsConfig(tls["cert"], tls["key"], tls["ca"])
    ca_only = TlsConfig(ca_file=tls["ca"])
    for name in ("meter", "tokenizer", "engine"):
        assert health_probe.check(up.address(name), tls=with_cert) == "SERVING", name
        assert health_probe.check(up.address(name), tls=ca_only) == "UNAVAILABLE", name
        assert health_probe.check(up.address(name)) == "UNAVAILABLE", name
    # the gateway is public: TLS with the CA, no certificate needed
    assert health_probe.check(up.address("gateway"), tls=ca_only) == "SERVING"
    # etcd: plaintext and certificate-less TLS are refused
    for creds in (None, grpc.ssl_channel_credentials(open(tls["ca"], "rb").read())):
        ch = (grpc.insecure_channel(up.address("etcd")) if creds is None
              else grpc.secure_channel(up.address("etcd"), creds))
        with ch, pytest.raises(grpc.RpcError) as err:
            rpc.KVStub(ch).Range(rpc.RangeRequest(key=b"/tokenserve/"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_printed_tsctl_status_line_works_with_the_etcd_certificate(up):
    line = printed(up, "Admin:")
    assert line[0] == "tsctl" and "--etcd-ca" in line
    r = subprocess.run([sys.executable, "-m", "controlplane.tsctl", *line[1:]], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "127.0.0.1" in r.stdout


def test_usage_reaches_the_meter_over_mutual_tls_and_the_printed_tsctl_usage_line_reads_it(up):
    # the requests of the tests above were billed: the gateway's and the engine's spools
    # send to the meter with the suite's certificate
    line = printed(up, "Usage:")
    assert line[0].startswith("TOKENSERVE_METER_TOKEN=") and "--tls-ca" in line
    start, end = line.index("tsctl") + 1, line.index("(the")  # then the explanation
    argv = [sys.executable, "-m", "controlplane.tsctl", *line[start:end], "--json", "--since",
            "1h", "--group-by", "tenant"]
    env = dict(os.environ, TOKENSERVE_METER_TOKEN=up.meter_token)

    def tokens() -> int:
        r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stderr
        return sum(row["total_tokens"] for row in json.loads(r.stdout))

    assert wait_for(lambda: tokens() > 0, timeout=60)


def test_tsctl_top_on_the_suite_dir_uses_the_suites_certificate(up):
    r = subprocess.run([sys.executable, "-m", "controlplane.tsctl", "--endpoints",
                        up.address("etcd"), "top", "--suite-dir", str(up.data_dir / "var"),
                        "--once", "--json", "--interval", "0.2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)
    assert view["etcd_error"] is None and view["registered"]["engines"] == [up.address("engine")]
    # the engines' GetInfo (running, waiting, KV) answers top only with the certificate
    tls = up.state["tls"]
    suite_tls = TlsConfig(tls["cert"], tls["key"], tls["ca"])
    assert asyncio.run(top.engine_info(up.address("engine"), suite_tls)) is not None
    assert asyncio.run(top.engine_info(up.address("engine"))) is None
