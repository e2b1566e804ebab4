"""One service as its own process, started by module name (`python -m services.meter ...`).

    proc = ServiceProcess("services.meter", ["--port", "50054", ...], 50054,
                          log_path=Path("var/logs/meter.log")).start(timeout=60)
    ...
    proc.stop()   # SIGTERM (graceful), SIGKILL after the grace period; returns the exit code

`start` = `spawn` (the process runs from the repository root with it first on PYTHONPATH, its
output appended to log_path) + `wait_serving` (polls the gRPC health check until SERVING).
The launcher (`tokenserve up`) and the integration tests start every service this way.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenserve.runtime.channels import sync_channel
from tokenserve.runtime.tls import PLAINTEXT, TlsConfig

ROOT = Path(__file__).resolve().parent.parent
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ServiceProcess:
    def __init__(self, module: str, args: list[str], port: int, *, log_path: Path,
                 env: dict[str, str] | None = None, tls: TlsConfig = PLAINTEXT):
        self.module, self.args, self.port, self.log_path = module, list(args), port, log_path
        # How the health check reaches it (the CA, and a client cert for mutual TLS).
        self.tls = tls
        # Added to the environment (secrets go here: arguments show in process listings).
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        # Health statuses seen while waiting to serve, in order, without repeats.
        self.statuses: list[int] = []

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def spawn(self) -> "ServiceProcess":
        """Starts the process and returns at once."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with open(self.log_path, "ab") as log:
            # Own session: a Ctrl-C in the launcher's terminal must not reach every service at
            # once; stop() signals them one by one.
            self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args],
                                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        return self

    def start(self, timeout: float = 60.0) -> "ServiceProcess":
        return self.spawn().wait_serving(timeout)

    def health(self) -> int | None:
        """The health check's status now; None while nothing answers."""
        with sync_channel(self.target, self.tls) as channel:
            try:
                return health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1.0).status
            except grpc.RpcError:
                return None

    def wait_serving(self, timeout: float, on_poll: Callable[[], None] | None = None
                     ) -> "ServiceProcess":
        """Returns once health says SERVING. Raises RuntimeError if the process exits first,
        TimeoutError (after stopping it) if it is not serving within timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited with {self.proc.returncode} while"
                                   f" starting; see {self.log_path}:\n{self.tail()}")
            status = self.health()
            if status is not None and (not self.statuses or self.statuses[-1] != status):
                self.statuses.append(status)
            if status == SERVING:
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.module} not serving after {timeout:.0f} s;"
                                   f" see {self.log_path}:\n{self.tail()}")
            if on_poll is not None:
                on_poll()
            # Health has no watch before the server is up; a short poll is the only signal.
            time.sleep(0.1)

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after grace seconds; the exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""
