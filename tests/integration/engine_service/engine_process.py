"""The engine as its own process (`python -m services.engine`), on ephemeral ports."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[3]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EngineProcess:
    def __init__(self, log_path: Path, *args: str):
        self.port = free_port()
        self.metrics_port = free_port()
        self.log_path = log_path
        self.args = ["--port", str(self.port), "--metrics-port", str(self.metrics_port),
                     "--max-concurrency", "16", "--max-batched-tokens", "128",
                     "--kv-cache-mb", "32", *args]
        self.proc: subprocess.Popen | None = None
        # Health statuses seen while starting, in order, without repeats.
        self.statuses: list[int] = []

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "EngineProcess":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.engine", *self.args], cwd=ROOT, stdout=log,
                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self

    def health(self) -> int | None:
        with grpc.insecure_channel(self.target) as ch:
            try:
                return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                            timeout=1.0).status
            except grpc.RpcError:
                return None

    def wait_serving(self, timeout: float = 600.0) -> "EngineProcess":
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.tail()}")
            status = self.health()
            if status is not None and (not self.statuses or self.statuses[-1] != status):
                self.statuses.append(status)
            if status == SERVING:
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"engine not serving after {timeout}s:\n{self.tail()}")
            # no health watch exists before the server is up; a short poll is the only signal
            time.sleep(0.1)

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def terminate(self, timeout: float = 60.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
