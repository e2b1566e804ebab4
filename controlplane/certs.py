"""Throw-away certificates for one machine: a CA and certificates for 127.0.0.1/localhost
that it signs, made with the `openssl` command (for `tokenserve up --tls` and the tests).

    ca = make_ca(directory)                      # ca.pem, ca.key
    cert = issue(ca, directory, "suite")         # suite.pem, suite.key: server + client use
    cert = local_suite_certs(directory)          # both, CA key deleted (`tokenserve up --tls`)

Keys are ECDSA P-256 (fast to make) and written owner-only; certificates last `days`.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tokenserve.runtime.errors import FailedPrecondition

_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


@dataclass(frozen=True)
class CertFiles:
    """A certificate, its key and the CA certificate that verifies it (PEM paths)."""

    cert: Path
    key: Path
    ca: Path


def _openssl(*args: str, cwd: Path) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise FailedPrecondition("TLS certificates need the openssl command; install OpenSSL")
    r = subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise FailedPrecondition(f"openssl {args[0]} failed: {r.stderr.strip()[-400:]}")


def make_ca(directory: Path, name: str = "ca", days: int = 30) -> CertFiles:
    """A self-signed CA: `<name>.pem` and `<name>.key` (`ca` is the CA itself)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", *_KEY, "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-days", str(days), "-subj", f"/CN=tokenserve {name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    os.chmod(d / f"{name}.key", 0o600)
    return CertFiles(d / f"{name}.pem", d / f"{name}.key", d / f"{name}.pem")


def issue(ca: CertFiles, directory: Path, name: str, *, hosts: tuple[str, ...] = ("127.0.0.1",
          "localhost"), days: int = 30) -> CertFiles:
    """`<name>.pem`/`<name>.key` signed by `ca`, for `hosts` (IPs or DNS names), usable both
    to serve TLS and as a client certificate."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    san = ",".join(f"IP:{h}" if h.replace(".", "").isdigit() or ":" in h else f"DNS:{h}"
                   for h in hosts)
    (d / f"{name}.ext").write_text(
        f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n"
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n")
    _openssl("req", *_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca.cert), "-CAkey", str(ca.key),
             "-set_serial", f"0x{secrets.token_hex(16)}", "-out", f"{name}.pem",
             "-days", str(days), "-extfile", f"{name}.ext", cwd=d)
    os.chmod(d / f"{name}.key", 0o600)
    (d / f"{name}.csr").unlink()
    (d / f"{name}.ext").unlink()
    return CertFiles(d / f"{name}.pem", d / f"{name}.key", ca.cert)


def local_suite_certs(directory: Path) -> CertFiles:
    """A fresh CA and one certificate for 127.0.0.1/localhost that every process of a local
    suite serves with and presents as its client certificate. The CA's key is deleted once the
    certificate is signed: nobody can issue another one that the suite would trust."""
    ca = make_ca(directory)
    cert = issue(ca, directory, "suite")
    ca.key.unlink()
    return cert
