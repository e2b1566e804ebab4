"""`python -m services.meter --port 50054 --metrics-port 9104 --db var/meter.db`"""
from __future__ import annotations

import argparse
import asyncio

from services.meter.config import MeterConfig
from services.meter.servicer import MeterServicer
from services.meter.store import Ledger
from tokenserve.meter.v1 import meter_pb2_grpc
from tokenserve.runtime.logging import configure_logging
from tokenserve.runtime.server import GrpcServer, Registration, ServerOptions
from tokenserve.runtime.config import add_server_args

SERVICE_NAME = "tokenserve.meter.v1.MeterService"


def parse_args(argv: list[str] | None = None) -> MeterConfig:
    p = argparse.ArgumentParser(prog="python -m services.meter",
                                description="tokenserve usage ledger (gRPC MeterService)")
    add_server_args(p, port=50054, metrics_port=9104)
    p.add_argument("--db", default="var/meter.db",
                   help="SQLite file (WAL) or a postgresql://user@host/db URL")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    try:
        return MeterConfig(host=a.host, port=a.port,
                           metrics_port=a.metrics_port,
                           db=a.db, log_level=a.log_level)
    except ValueError as e:
        p.error(str(e))


async def serve(config: MeterConfig):
    log = configure_logging("meter", config.log_level)
    ledger = Ledger.open(config.db)
    servicer = MeterServicer(ledger)
    server = GrpcServer(
        "meter",
        [Registration(SERVICE_NAME, meter_pb2_grpc.add_MeterServiceServicer_to_server, servicer)],
        ServerOptions(host=config.host, port=config.port, metrics_port=config.metrics_port),
        on_stop=[servicer.close])
    log.info("ledger_open", backend="postgresql" if config.postgres else "sqlite")
    await server.run()


def main(argv: list[str] | None = None) -> int:
    asyncio.run(serve(parse_args(argv)))
    return 0
