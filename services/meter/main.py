"""`python -m services.meter --port 50054 --metrics-port 9104 --db var/meter.db
[--etcd-endpoints 127.0.0.1:2379] [--reconcile-interval-seconds 60]`

With $TOKENSERVE_METER_TOKEN set, every MeterService call must carry `authorization: Bearer
<that token>` (the gateway, the engines and tsctl send it from the same variable)."""
from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from services.meter.config import MeterConfig
from services.meter.drift import PeriodicReconcile
from services.meter.migrations import SchemaTooNew
from services.meter.servicer import MeterServicer
from services.meter.store import Ledger
from services.meter.usage import IngestRules
from tokenserve.meter.v1 import meter_pb2_grpc
from tokenserve.runtime.config import add_server_args
from controlplane.etcd_client import (ETCD_PASSWORD_ENV, add_etcd_auth_args,
                                      etcd_credentials_from_args)
from tokenserve.runtime.errors import ServiceError
from tokenserve.runtime.tls import tls_from_args
from tokenserve.runtime.logging import configure_logging, get_logger
from tokenserve.runtime.server import GrpcServer, Registration, ServerOptions
from tokenserve.runtime.service_token import METER_TOKEN_ENV, RequireToken

SERVICE_NAME = "tokenserve.meter.v1.MeterService"


def parse_args(argv: list[str] | None = None) -> MeterConfig:
    p = argparse.ArgumentParser(prog="python -m services.meter",
                                description="tokenserve usage ledger (gRPC MeterService)")
    add_server_args(p, port=50054, metrics_port=9104)
    p.add_argument("--db", default="var/meter.db",
                   help="SQLite file (WAL) or a postgresql://user@host/db URL")
    p.add_argument("--max-age-seconds", type=float, default=MeterConfig.max_age_seconds,
                   help="refuse events that finished longer ago than this (default 35 days)")
    p.add_argument("--max-ahead-seconds", type=float, default=MeterConfig.max_ahead_seconds,
                   help="refuse events that finish further in the future (default 300)")
    p.add_argument("--etcd-endpoints", default="",
                   help="host:port[,...]; events of tenants not configured there are refused")
    add_etcd_auth_args(p)
    p.add_argument("--config-snapshot", type=Path, default=None,
                   help="last known good etcd config (used when etcd is down at start)")
    p.add_argument("--reconcile-interval-seconds", type=float,
                   default=MeterConfig.reconcile_interval_seconds,
                   help="reconcile gateway and engine records this often, publishing the"
                        " drift gauge (default 60; 0: only when asked)")
    p.add_argument("--reconcile-window-seconds", type=float,
                   default=MeterConfig.reconcile_window_seconds,
                   help="how far back the periodic reconcile looks (default 3600)")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    try:
        return MeterConfig(
            host=a.host, port=a.port, metrics_port=a.metrics_port, db=a.db,
            max_age_seconds=a.max_age_seconds, max_ahead_seconds=a.max_ahead_seconds,
            etcd_endpoints=tuple(e.strip() for e in a.etcd_endpoints.split(",") if e.strip()),
            config_snapshot=a.config_snapshot,
            reconcile_interval_seconds=a.reconcile_interval_seconds,
            reconcile_window_seconds=a.reconcile_window_seconds, log_level=a.log_level,
            token=os.environ.get(METER_TOKEN_ENV) or None, tls=tls_from_args(a),
            etcd_credentials=etcd_credentials_from_args(a, os.environ.get(ETCD_PASSWORD_ENV)))
    except ValueError as e:
        p.error(str(e))
    except ServiceError as e:
        p.error(e.message)


async def serve(config: MeterConfig) -> int:
    log = configure_logging("meter", config.log_level)
    try:
        ledger = Ledger.open(config.db)
    except SchemaTooNew as e:
        log.error("ledger_schema_too_new", error=e.message)
        return 1
    on_stop = []
    known_tenants = None
    if config.etcd_endpoints:
        from controlplane.watcher import ConfigWatcher

        watcher = ConfigWatcher(config.etcd_credentials.options(config.etcd_endpoints),
                                service="meter",
                                snapshot_path=config.config_snapshot)
        await watcher.start()
        on_stop.append(watcher.close)
        known_tenants = lambda: watcher.snapshot.tenants.keys()  # noqa: E731
    rules = IngestRules(max_age_seconds=config.max_age_seconds,
                        max_ahead_seconds=config.max_ahead_seconds,
                        **({"known_tenants": known_tenants} if known_tenants else {}))
    servicer = MeterServicer(ledger, rules)
    if config.reconcile_interval_seconds > 0:
        periodic = PeriodicReconcile(config.db, interval=config.reconcile_interval_seconds,
                                     window=config.reconcile_window_seconds)
        periodic.start()
        on_stop.insert(0, periodic.close)
    server = GrpcServer(
        "meter",
        [Registration(SERVICE_NAME, meter_pb2_grpc.add_MeterServiceServicer_to_server, servicer)],
        ServerOptions(host=config.host, port=config.port, metrics_port=config.metrics_port,
                      tls=config.tls),
        on_stop=[servicer.close, *on_stop],
        interceptors=(RequireToken(config.token, "tokenserve.meter.v1."),) if config.token else ())
    log.info("ledger_open", backend="postgresql" if config.postgres else "sqlite",
             journal_mode=ledger.journal_mode(), schema_version=ledger.schema_version,
             tenant_check=known_tenants is not None, token_required=config.token is not None,
             reconcile_interval_seconds=config.reconcile_interval_seconds)
    await server.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        return asyncio.run(serve(config))
    except ServiceError as e:  # e.g. etcd refused us and no last-known-good snapshot
        get_logger(component="meter").error("meter_start_failed", error=e.message)
        return 1
