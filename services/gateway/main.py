"""`python -m services.gateway --port 50051 --http-port 8080 --metrics-port 9101
--etcd-endpoints 127.0.0.1:2379 --tokenizer 127.0.0.1:50052 --meter 127.0.0.1:50054
[--engine model=version=host:port ...] --snapshot var/gateway-config.json
--spool var/gateway-spool.db`"""
from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import structlog

from controlplane.registry import register_with_retry
from controlplane.schema import GatewayRegistration
from controlplane.watcher import ConfigWatcher
from services.gateway import metrics
from services.gateway.config import GatewayConfig, StaticEngine
from services.gateway.downstream import Channels, EngineClient, MeterClient, TokenizerClient
from services.gateway.http import HttpFront
from services.gateway.inference import ConfigSource, Pipeline
from services.gateway.quota_store import (MemoryQuotaStore, NoQuotaStore, QuotaStore,
                                          RedisQuotaStore)
from services.gateway.routing import Router
from services.gateway.servicer import InferenceServicer, add_to_server

from tokenserve.runtime.channels import aio_channel
from tokenserve.runtime.errors import ServiceError
from tokenserve.runtime.logging import configure_logging
from tokenserve.runtime.server import GrpcServer, Registration, ServerOptions
from tokenserve.runtime.service_token import METER_TOKEN_ENV
from tokenserve.runtime.config import add_server_args
from tokenserve.spool import DURABILITIES, SpoolSender, UsageSpool

SERVICE_NAME = "tokenserve.gateway.v1.InferenceService"
# Lazy: resolved at first use, after configure_logging (JSON lines).
log = structlog.get_logger(component="gateway")


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="python -m services.gateway",
                                description="tokenserve public API (gRPC InferenceService and an"
                                            " OpenAI-compatible HTTP API)")
    add_server_args(p, port=50051, metrics_port=9101)
    p.add_argument("--http-port", type=int, default=GatewayConfig.http_port,
                   help="OpenAI-compatible HTTP API port; -1 disables it, 0 picks a free one")
    p.add_argument("--etcd-endpoints", default="127.0.0.1:2379",
                   help="comma-separated host:port list")
    p.add_argument("--tokenizer", default="127.0.0.1:50052")
    p.add_argument("--meter", default="127.0.0.1:50054")
    p.add_argument("--engine", action="append", default=[], metavar="MODEL=VERSION=HOST:PORT",
                   help="an engine to route to without an etcd registration (repeatable)")
    p.add_argument("--snapshot", default="var/gateway-config.json",
                   help="last known good control-plane config (used when etcd is down)")
    p.add_argument("--spool", default="var/gateway-spool.db",
                   help="SQLite file holding usage events until the meter has them")
    p.add_argument("--spool-durability", choices=DURABILITIES, default="process",
                   help="how durable a usage record is before the request's last message: process (survives a crash of the service; on disk within 50 ms) or disk (fsync first; concurrent requests share one)")
    p.add_argument("--default-model", default=GatewayConfig.default_model)
    p.add_argument("--request-timeout", type=float, default=30.0,
                   help="seconds allowed to a call that carries no deadline")
    p.add_argument("--quota-store", default="memory", metavar="memory|redis://HOST:PORT/DB|off",
                   help="where admission counters live: this process (one gateway) or Redis"
                        " shared by several gateways; 'off' enforces no limits (benchmarks)")
    p.add_argument("--quota-fail", choices=("closed", "open"), default="closed",
                   help="with Redis unreachable: refuse requests (closed) or admit against this"
                        " gateway's share of each limit (open)")
    p.add_argument("--gateway-id", default="", help="registration id in etcd (default: host-port)")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    try:
        return GatewayConfig(
            host=a.host, port=a.port, metrics_port=a.metrics_port,
            http_port=None if a.http_port < 0 else a.http_port,
            etcd_endpoints=tuple(e.strip() for e in a.etcd_endpoints.split(",") if e.strip()),
            tokenizer=a.tokenizer, meter=a.meter,
            engines=tuple(StaticEngine.parse(e) for e in a.engine),
            snapshot_path=a.snapshot, spool_path=a.spool,
            spool_durability=a.spool_durability, default_model=a.default_model,
            request_timeout_seconds=a.request_timeout, quota_store=a.quota_store,
            quota_fail=a.quota_fail, gateway_id=a.gateway_id,
            log_level=a.log_level, meter_token=os.environ.get(METER_TOKEN_ENV) or None)
    except ValueError as e:
        p.error(str(e))


def quota_store(config: GatewayConfig, source: ConfigSource) -> QuotaStore:
    if config.quota_store == "memory":
        return MemoryQuotaStore()
    if config.quota_store == "off":
        log.warning("quota_store_off", detail="no tier limit or token quota is enforced")
        return NoQuotaStore()
    return RedisQuotaStore(config.quota_store, fail=config.quota_fail,
                           live_gateways=lambda: len(source.snapshot.gateways))


def build(config: GatewayConfig,
          source: ConfigSource) -> tuple[GrpcServer, SpoolSender, HttpFront | None]:
    """The gRPC server, its usage sender and the HTTP front (None when off), wired to `source`
    (a started ConfigWatcher, or any holder of a snapshot) and one pipeline. Start the sender
    and the HTTP front once the loop runs; stopping the server stops the HTTP front first,
    then flushes the sender."""
    spool = UsageSpool(config.spool_path, config.spool_durability)
    metrics.USAGE_EVENTS_SPOOLED.set(len(spool))
    meter_channel = aio_channel(config.meter, token=config.meter_token)
    tokenizer_channel = aio_channel(config.tokenizer)
    meter = MeterClient(meter_channel)
    sender = SpoolSender(spool, meter.record,
                         batch_size=config.spool_batch_size,
                         max_backoff=config.spool_max_backoff_seconds,
                         on_sent=lambda n: (metrics.USAGE_EVENTS_SENT.inc(n),
                                            metrics.USAGE_EVENTS_SPOOLED.dec(n)))
    channels = Channels()
    quotas = quota_store(config, source)
    pipeline = Pipeline(source, Router(config.engines, config.default_model),
                        TokenizerClient(tokenizer_channel), EngineClient(channels), quotas,
                        spool, sender, max_engine_attempts=config.max_engine_attempts)

    async def close_all():
        await sender.stop()
        spool.close()
        await quotas.close()
        await channels.close()
        await meter_channel.close()
        await tokenizer_channel.close()

    options = ServerOptions(host=config.host, port=config.port, metrics_port=config.metrics_port)
    http = None
    if config.http_port is not None:
        http = HttpFront(pipeline, config.request_timeout_seconds, host=config.host,
                         port=config.http_port, grace_seconds=options.grace_seconds,
                         max_body_bytes=options.max_message_bytes)
    server = GrpcServer(
        "gateway",
        [Registration(SERVICE_NAME, add_to_server,
                      InferenceServicer(pipeline, config.request_timeout_seconds, meter))],
        options, on_stop=([http.stop] if http else []) + [close_all])
    return server, sender, http


async def _register_when_possible(config: GatewayConfig, port: int):
    """Announces this gateway in etcd under a lease; retries while etcd is unreachable."""
    gid = config.gateway_id or f"gateway-{config.host}-{port}"
    reg = GatewayRegistration(id=gid.replace(":", "-"), endpoint=f"{config.host}:{port}")
    return await register_with_retry(list(config.etcd_endpoints), "gateways", reg, ttl=5)


async def serve(config: GatewayConfig):
    configure_logging("gateway", config.log_level)
    watcher = ConfigWatcher(list(config.etcd_endpoints), snapshot_path=Path(config.snapshot_path),
                            service="gateway")
    await watcher.start()
    server, sender, http = build(config, watcher)
    if http is not None:
        await http.start()  # listening before health says SERVING
    port = await server.start()
    sender.start()
    registering = asyncio.create_task(_register_when_possible(config, port))

    async def unregister():
        # Bounded: a cancel that races a watch event can be lost inside the watcher
        # (asyncio.wait_for in 3.11); asyncio.run cancels whatever is left on exit.
        try:
            await asyncio.wait_for(watcher.close(), 3.0)
        except asyncio.TimeoutError:
            log.warning("config_watcher_close_timed_out")
        if registering.done() and not registering.cancelled() and registering.exception() is None:
            await registering.result().close()
        else:
            registering.cancel()

    server.on_stop.append(unregister)
    await server.run()


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        asyncio.run(serve(config))
    except ServiceError as e:  # e.g. no etcd and no last-known-good snapshot: no policy
        log.error("gateway_start_failed", error=e.message)
        return 1
    return 0
