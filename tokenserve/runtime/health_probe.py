"""`python -m tokenserve.runtime.health_probe HOST:PORT`: exit 0 when the server's
grpc.health.v1 check answers SERVING, 1 otherwise (the container health check).

    python -m tokenserve.runtime.health_probe 127.0.0.1:50051 --timeout 2
    python -m tokenserve.runtime.health_probe 127.0.0.1:50053 --tls-ca ca.pem \
        --tls-cert client.pem --tls-key client.key     # a TLS (mutual TLS) server
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenserve.runtime.channels import sync_channel
from tokenserve.runtime.tls import PLAINTEXT, TlsConfig, add_tls_args, tls_from_args


def check(address: str, service: str = "", timeout: float = 2.0,
          tls: TlsConfig = PLAINTEXT) -> str:
    """The health status name (SERVING, NOT_SERVING, ...), or the gRPC error code's name."""
    with sync_channel(address, tls) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenserve.runtime.health_probe",
                                description="grpc.health.v1 check for container health probes")
    p.add_argument("address", help="host:port of the gRPC server")
    p.add_argument("--service", default="", help="service name to check (default: the server)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds")
    add_tls_args(p, serving=False)
    a = p.parse_args(argv)
    try:
        tls = tls_from_args(a)
    except ValueError as e:
        p.error(str(e))
    status = check(a.address, a.service, a.timeout, tls)
    print(f"{a.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
