"""Starts a service as its own process (`python -m services.<name> ...`) and waits until its
gRPC health check says SERVING; stops it with SIGTERM (graceful) and reaps it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[3]


class ServiceProcess:
    def __init__(self, module: str, args: list[str], port: int, *, log_path: Path):
        self.module, self.args, self.port, self.log_path = module, args, port, log_path
        self.proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServiceProcess":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args],
                                     cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        self.wait_serving(timeout)
        return self

    def wait_serving(self, timeout: float):
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.module} exited with {self.proc.returncode}:\n"
                                       f"{self.log_path.read_text()[-3000:]}")
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"{self.module} not serving after {timeout}s:\n"
                                       f"{self.log_path.read_text()[-3000:]}")
                # Health has no watch before the server is up; a short poll is the only signal.
                time.sleep(0.1)

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
