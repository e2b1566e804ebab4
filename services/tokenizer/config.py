"""Tokenizer service settings, validated on construction (main.py is the only place that reads flags)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from tokenserve.runtime.config import check_ports
from controlplane.etcd_client import EtcdCredentials
from tokenserve.runtime.tls import PLAINTEXT, TlsConfig
from tokenserve.tokenization import MAX_TEXT_BYTES

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# gRPC's own receive limit (ServerOptions.max_message_bytes) caps a request above this.
MAX_TEXT_BYTES_CEILING = 16 * 1024 * 1024


@dataclass(frozen=True)
class TokenizerConfig:
    # name -> model artifact (GGUF file or Hugging Face folder); tokenizers load lazily.
    models: dict[str, Path] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 50052
    # None: no /metrics endpoint; 0: any free port.
    metrics_port: int | None = 9102
    # Largest text (or chat, all strings together) one input may hold, in UTF-8 bytes.
    max_text_bytes: int = MAX_TEXT_BYTES
    # Most inputs in one batch call.
    max_batch_items: int = 1024
    # gRPC handler threads: requests encoded or decoded at once (the library's batch calls
    # release the GIL and spread a batch over the cores themselves).
    workers: int = 4
    # Load every configured tokenizer before reporting SERVING (instead of on first use).
    preload: bool = False
    # etcd endpoints ("host:port"); models under /tokenserve/v1/models/ are added when given.
    etcd_endpoints: tuple[str, ...] = ()
    # Last known good etcd config, used when etcd is unreachable at start.
    config_snapshot: Path | None = None
    log_level: str = "info"
    # TLS of its listeners and of the channels it opens (tokenserve.runtime.tls).
    tls: TlsConfig = PLAINTEXT
    # How it reaches etcd: TLS, client certificate, user/password (controlplane.etcd_client).
    etcd_credentials: EtcdCredentials = EtcdCredentials()

    def __post_init__(self):
        check_ports(self.port, self.metrics_port)
        if not 1 <= self.max_text_bytes <= MAX_TEXT_BYTES_CEILING:
            raise ValueError(
                f"max_text_bytes must be in 1..{MAX_TEXT_BYTES_CEILING}, got {self.max_text_bytes}")
        if not 1 <= self.max_batch_items <= 100_000:
            raise ValueError(f"max_batch_items must be in 1..100000, got {self.max_batch_items}")
        if not 1 <= self.workers <= 64:
            raise ValueError(f"workers must be in 1..64, got {self.workers}")
        if not self.models and not self.etcd_endpoints:
            raise ValueError("no models: give at least one --model name=path (or --etcd-endpoints)")
        for name, path in self.models.items():
            if not MODEL_NAME.fullmatch(name):
                raise ValueError(f"model name {name!r} must match {MODEL_NAME.pattern}")
            if not Path(path).exists():
                raise ValueError(f"model {name!r}: {path} does not exist")
