"""The container health check: exit 0 only while the server's grpc.health.v1 says SERVING."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tokenserve.runtime.health_probe import main


def test_exit_code_follows_the_servers_health(capsys):
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert main([f"127.0.0.1:{port}"]) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # draining
        assert main([f"127.0.0.1:{port}"]) == 1
        assert main([f"127.0.0.1:{port}", "--service", "no.such.Service"]) == 1
    finally:
        server.stop(None)
    assert main([f"127.0.0.1:{port}", "--timeout", "0.5"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(": SERVING") and lines[1].endswith(": NOT_SERVING")
    assert lines[2].endswith(": NOT_FOUND") and lines[3].endswith(": UNAVAILABLE")
