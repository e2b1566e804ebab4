"""etcd over TLS with client certificates: store and tsctl connect with the TLS options."""
from __future__ import annotations

import os
import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.etcd_local import EtcdProcess, ServerTls
from controlplane.schema import Tier
from controlplane.store import ConfigStore
from tokenserve.runtime.ports import free_port
from tokenserve.runtime.errors import Unavailable

pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None and os.environ.get("CI") != "true", reason="needs the openssl CLI")


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(d: Path) -> dict[str, str]:
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "1", "-subj", "/CN=test-ca", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
    return {k: str(d / v) for k, v in {"ca": "ca.pem", "cert": "client.pem", "key": "client.key",
                                         "server_cert": "server.pem", "server_key": "server.key"}.items()}


@pytest.fixture
def tls_etcd(tmp_path):
    certs = make_certs(tmp_path)
    proc = EtcdProcess(tmp_path / "etcd", free_port(), free_port(), unsafe_no_fsync=True,
                       tls=ServerTls(certs["server_cert"], certs["server_key"], certs["ca"],
                                     client_cert_auth=True))
    proc.start()
    try:
        yield proc, certs
    finally:
        proc.kill()


async def test_store_and_tsctl_over_mutual_tls(tls_etcd):
    proc, c = tls_etcd
    async with ConfigStore([proc.endpoint], ca_file=c["ca"], cert_file=c["cert"], key_file=c["key"]) as s:
        await s.create(Tier("free", 10, 100, 1000, 1, 0, 16), actor="ops")
        assert (await s.require("tiers/free")).document.requests_per_second == 10
    async with ConfigStore([proc.endpoint], timeout=2) as plain:  # no TLS: refused
        with pytest.raises(Unavailable):
            await plain.get("tiers/free")
    r = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "controlplane.tsctl", "--endpoints", proc.endpoint, "--etcd-ca", c["ca"],
        "--etcd-cert", c["cert"], "--etcd-key", c["key"], "--json", "tier", "show", "free"],
        capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert '"requests_per_second": 10' in r.stdout
