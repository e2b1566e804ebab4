"""`python -m services.gateway --port 50051 --http-port 8080 --metrics-port 9101
--etcd-endpoints 127.0.0.1:2379 --tokenizer 127.0.0.1:50052 --meter 127.0.0.1:50054
[--engine model=version=host:port ...] --snapshot var/gateway-config.json
--spool var/gateway-spool.db`"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import structlog

from controlplane import admin
from controlplane.etcd_client import (ETCD_PASSWORD_ENV, add_etcd_auth_args,
                                      etcd_credentials_from_args)
from controlplane.registry import register_with_retry
from controlplane.schema import MAX_CANARY_WINDOW_SECONDS, GatewayRegistration
from controlplane.snapshot import ConfigSnapshot
from controlplane.store import ConfigStore
from controlplane.watcher import ConfigWatcher
from services.gateway import metrics
from services.gateway.affinity import PrefixAffinity
from services.gateway.canary import CanaryGuardian
from services.gateway.config import TOKENIZE_MODES, GatewayConfig, StaticEngine
from services.gateway.downstream import Channels, EngineClient, MeterClient, TokenizerClient
from services.gateway.governor import Governor
from services.gateway.health import EjectionPolicy, ReplicaHealth
from services.gateway.http import HttpFront
from services.gateway.inference import ConfigSource, Pipeline
from services.gateway.load import LoadBoard, LoadSubscriptions
from services.gateway.prober import Prober
from services.gateway.quota_store import (MemoryQuotaStore, NoQuotaStore, QuotaStore,
                                          RedisQuotaStore)
from services.gateway.routing import Router
from services.gateway.servicer import InferenceServicer, add_to_server
from services.gateway.tokenizers import Tokenizers
from services.gateway.version_stats import VersionStats

from tokenserve.runtime.channels import aio_channel
from tokenserve.runtime.errors import ServiceError
from tokenserve.runtime.logging import configure_logging
from tokenserve.runtime.server import GrpcServer, Registration, ServerOptions
from tokenserve.runtime.service_token import METER_TOKEN_ENV
from tokenserve.runtime.config import add_server_args
from tokenserve.runtime.tls import tls_from_args
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
    add_etcd_auth_args(p)
    p.add_argument("--tokenizer", default="127.0.0.1:50052")
    p.add_argument("--tokenize", choices=TOKENIZE_MODES, default="auto",
                   help="prompt ids: auto (default) encodes in this process where the model's"
                        " artifact is readable here, else through the tokenizer service; remote:"
                        " always the tokenizer service")
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
    p.add_argument("--prefix-affinity", action=argparse.BooleanOptionalAction,
                   default=GatewayConfig.prefix_affinity,
                   help="send a tenant's repeated prompt prefix to the engine replica that"
                        " served it, unless that replica is much busier")
    ej = EjectionPolicy()
    p.add_argument("--eject-after", type=int, default=ej.failures, metavar="N",
                   help="UNAVAILABLE calls in a row that take an engine replica out of routing")
    p.add_argument("--eject-backoff", type=float, default=ej.backoff_seconds, metavar="S",
                   help="seconds out after the first ejection; doubles per ejection in a row")
    p.add_argument("--eject-backoff-max", type=float, default=ej.max_backoff_seconds,
                   metavar="S", help="the longest time out of routing before a health probe")
    p.add_argument("--gateway-id", default="", help="registration id in etcd (default: host-port)")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    try:
        return GatewayConfig(
            host=a.host, port=a.port, metrics_port=a.metrics_port,
            http_port=None if a.http_port < 0 else a.http_port,
            etcd_endpoints=tuple(e.strip() for e in a.etcd_endpoints.split(",") if e.strip()),
            tokenizer=a.tokenizer, tokenize=a.tokenize, meter=a.meter,
            engines=tuple(StaticEngine.parse(e) for e in a.engine),
            snapshot_path=a.snapshot, spool_path=a.spool,
            spool_durability=a.spool_durability, default_model=a.default_model,
            request_timeout_seconds=a.request_timeout, quota_store=a.quota_store,
            quota_fail=a.quota_fail, gateway_id=a.gateway_id,
            prefix_affinity=a.prefix_affinity,
            ejection=EjectionPolicy(failures=a.eject_after, deadlines=ej.deadlines,
                                    backoff_seconds=a.eject_backoff,
                                    max_backoff_seconds=a.eject_backoff_max),
            log_level=a.log_level, meter_token=os.environ.get(METER_TOKEN_ENV) or None,
            tls=tls_from_args(a),
            etcd_credentials=etcd_credentials_from_args(a, os.environ.get(ETCD_PASSWORD_ENV)))
    except ValueError as e:
        p.error(str(e))
    except ServiceError as e:
        p.error(e.message)


def quota_store(config: GatewayConfig, source: ConfigSource) -> QuotaStore:
    if config.quota_store == "memory":
        return MemoryQuotaStore()
    if config.quota_store == "off":
        log.warning("quota_store_off", detail="no tier limit or token quota is enforced")
        return NoQuotaStore()
    return RedisQuotaStore(config.quota_store, fail=config.quota_fail,
                           live_gateways=lambda: len(source.snapshot.gateways))


def router_for(config: GatewayConfig, board: LoadBoard | None = None) -> Router:
    """The router with replica health (ejection), the engines' load reports from `board`
    and, when on, prefix affinity."""
    health = ReplicaHealth(config.ejection)
    metrics.REPLICAS_EJECTED.set_function(lambda: len(health.ejected()))
    return Router(config.engines, config.default_model, health=health,
                  load_of=board.get if board is not None else None,
                  affinity=PrefixAffinity() if config.prefix_affinity else None)


def build(config: GatewayConfig, source: ConfigSource, router: Router, board: LoadBoard, *,
          watch: Callable[[Callable[[ConfigSnapshot], None]], object] | None = None,
          ) -> tuple[GrpcServer, list[Callable[[], None]], HttpFront | None, Governor]:
    """The gRPC server, what to start once the loop runs (the usage sender, the replica
    prober, the degradation loop), the HTTP front (None when off) and the degradation
    governor, wired to `source` (a started ConfigWatcher, or any holder of a snapshot),
    `router` (router_for, reading `board`), the engines' load reports on `board` and one
    pipeline. `watch` subscribes a callback to config changes (ConfigWatcher.on_change).
    Stopping the server stops the HTTP front first, then the governor, then flushes the
    sender."""
    spool = UsageSpool(config.spool_path, config.spool_durability)
    metrics.USAGE_EVENTS_SPOOLED.set(len(spool))
    meter_channel = aio_channel(config.meter, token=config.meter_token, tls=config.tls)
    tokenizer_channel = aio_channel(config.tokenizer, tls=config.tls)
    meter = MeterClient(meter_channel)
    sender = SpoolSender(spool, meter.record,
                         batch_size=config.spool_batch_size,
                         max_backoff=config.spool_max_backoff_seconds,
                         on_sent=lambda n: (metrics.USAGE_EVENTS_SENT.inc(n),
                                            metrics.USAGE_EVENTS_SPOOLED.dec(n)))
    channels = Channels(config.tls)
    engines = EngineClient(channels)
    quotas = quota_store(config, source)
    # Tokenizer loads and long prompts run here, off the event loop.
    tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
    tokenizers = Tokenizers(TokenizerClient(tokenizer_channel), tokenize_pool,
                            local=config.tokenize == "auto")
    tokenizers.apply(source.snapshot)
    if watch is not None:
        watch(tokenizers.apply)
    governor = Governor(lambda: source.snapshot, config.engines, board,
                        LoadSubscriptions(board, engines.watch_load))
    prober = Prober(router.health, engines.serving)
    router.health.subscribe(prober.on_eject)
    # Canary rollbacks: this gateway's own writes to the control plane, audited under its id.
    store = ConfigStore(config.etcd_credentials.options(config.etcd_endpoints))
    actor = f"gateway:{config.gateway_id or f'{socket.gethostname()}-{os.getpid()}'}"
    stats = VersionStats(retain_seconds=MAX_CANARY_WINDOW_SECONDS)
    guardian = CanaryGuardian(stats, lambda model, version, reason: admin.roll_back_canary(
        store, model, version, reason, actor=actor))
    pipeline = Pipeline(source, router, tokenizers, engines, quotas, spool, sender,
                        max_engine_attempts=config.max_engine_attempts,
                        stats=stats, guardian=guardian, degradation=governor.decide)

    async def close_all():
        await governor.stop()
        await sender.stop()
        await prober.stop()
        await guardian.close()
        spool.close()
        await quotas.close()
        await store.close()
        await channels.close()
        await meter_channel.close()
        await tokenizer_channel.close()
        tokenize_pool.shutdown(wait=False, cancel_futures=True)

    options = ServerOptions(host=config.host, port=config.port, metrics_port=config.metrics_port,
                            tls=config.tls)
    http = None
    if config.http_port is not None:
        http = HttpFront(pipeline, config.request_timeout_seconds, host=config.host,
                         port=config.http_port, grace_seconds=options.grace_seconds,
                         max_body_bytes=options.max_message_bytes, tls=config.tls)
    server = GrpcServer(
        "gateway",
        [Registration(SERVICE_NAME, add_to_server,
                      InferenceServicer(pipeline, config.request_timeout_seconds, meter))],
        options, on_stop=([http.stop] if http else []) + [close_all], on_drain=[pipeline.drain])
    return server, [sender.start, prober.start, governor.start], http, governor


async def _register_when_possible(config: GatewayConfig, port: int):
    """Announces this gateway in etcd under a lease; retries while etcd is unreachable."""
    gid = config.gateway_id or f"gateway-{config.host}-{port}"
    reg = GatewayRegistration(id=gid.replace(":", "-"), endpoint=f"{config.host}:{port}")
    return await register_with_retry(config.etcd_credentials.options(config.etcd_endpoints),
                                     "gateways", reg, ttl=5)


async def _publish_level(governor: Governor, registering: asyncio.Task) -> None:
    """Rewrites this gateway's registration with its degradation level when the level
    changes (at most once a second), for `tsctl status`."""
    handle = await registering
    while True:
        await governor.changed.wait()
        governor.changed.clear()
        state = governor.state
        try:
            await handle.update(dataclasses.replace(
                handle.registration, degradation_level=state.level,
                degradation_reason=state.reason))
        except ServiceError as e:  # etcd down: the level is written once it is back
            log.warning("degradation_level_publish_failed", error=e.message)
            governor.changed.set()
        await asyncio.sleep(1.0)


async def serve(config: GatewayConfig):
    configure_logging("gateway", config.log_level)
    watcher = ConfigWatcher(config.etcd_credentials.options(config.etcd_endpoints),
                            snapshot_path=Path(config.snapshot_path),
                            service="gateway")
    await watcher.start()
    board = LoadBoard()
    router = router_for(config, board)
    # At start (the first snapshot holds the engines registered so far), then on every change.
    router.log_context_mismatches(watcher.snapshot)
    watcher.on_change(router.log_context_mismatches)
    server, background, http, governor = build(config, watcher, router, board,
                                               watch=watcher.on_change)
    if http is not None:
        await http.start()  # listening before health says SERVING
    port = await server.start()
    for start in background:
        start()
    registering = asyncio.create_task(_register_when_possible(config, port))
    publishing = asyncio.create_task(_publish_level(governor, registering))

    async def unregister():
        publishing.cancel()
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
