"""Gateway settings, validated on construction (main.py is the only place that reads flags)."""
from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.etcd_client import EtcdCredentials
from services.gateway.health import EjectionPolicy
from tokenserve.models import DEFAULT_MODEL_NAME
from tokenserve.runtime.config import check_endpoint, check_ports
from tokenserve.runtime.tls import PLAINTEXT, TlsConfig


@dataclass(frozen=True)
class StaticEngine:
    """An engine given on the command line (`--engine model=version=host:port`), routed to
    even when no engine registered itself in etcd."""

    model: str
    version: str
    endpoint: str

    def __post_init__(self):
        if not self.model or not self.version:
            raise ValueError("--engine must be model=version=host:port")
        check_endpoint("--engine endpoint", self.endpoint)

    @classmethod
    def parse(cls, text: str) -> "StaticEngine":
        parts = text.split("=")
        if len(parts) != 3:
            raise ValueError(f"--engine must be model=version=host:port, got {text!r}")
        return cls(*parts)


TOKENIZE_MODES = ("auto", "remote")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    # None: no /metrics endpoint; 0: any free port.
    metrics_port: int | None = 9101
    # The OpenAI-compatible HTTP front. None: off; 0: any free port.
    http_port: int | None = 8080
    etcd_endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    tokenizer: str = "127.0.0.1:50052"
    # Prompt ids: "auto" encodes in this process where the model's artifact is readable here
    # (services/gateway/tokenizers.py), else through the tokenizer service; "remote": always
    # the tokenizer service.
    tokenize: str = "auto"
    meter: str = "127.0.0.1:50054"
    engines: tuple[StaticEngine, ...] = ()
    # Last known good control-plane config (start from it when etcd is down).
    snapshot_path: str = "var/gateway-config.json"
    spool_path: str = "var/gateway-spool.db"
    # How durable a usage record is before the last message: "process" or "disk"
    # (tokenserve.spool.DURABILITIES).
    spool_durability: str = "process"
    default_model: str = DEFAULT_MODEL_NAME
    # Deadline applied when the caller sets none.
    request_timeout_seconds: float = 30.0
    # Engines tried per request when they answer UNAVAILABLE before the first token.
    max_engine_attempts: int = 3
    # When a failing engine replica leaves routing and for how long (health.py).
    ejection: EjectionPolicy = field(default_factory=EjectionPolicy)
    # Send a tenant's repeated prompt prefix to the replica that served it (affinity.py).
    # On: a repeated prefix (a chat's earlier turns, a system prompt) is prefilled once per
    # replica instead of once per replica it happens to land on, and the load guard keeps a
    # hot prefix from piling onto one replica; with one replica per version it changes nothing.
    prefix_affinity: bool = True
    # Usage sender: events per RecordUsage call, and the longest wait between retries.
    spool_batch_size: int = 500
    spool_max_backoff_seconds: float = 30.0
    # Where admission keeps its counters: "memory" (this process; one gateway), a
    # redis://host:port/db URL shared by several gateways, or "off" (no limits enforced).
    quota_store: str = "memory"
    # With Redis unreachable: "closed" refuses requests (UNAVAILABLE), "open" admits against
    # this gateway's share of each limit (limit / live gateways).
    quota_fail: str = "closed"
    # Registration in etcd (gateway id; empty: host:port).
    gateway_id: str = ""
    log_level: str = "info"
    # The meter's service token, sent on every meter call (None: the meter wants none).
    meter_token: str | None = field(default=None, repr=False)
    # TLS of its listeners and of the channels it opens (tokenserve.runtime.tls).
    tls: TlsConfig = PLAINTEXT
    # How it reaches etcd: TLS, client certificate, user/password (controlplane.etcd_client).
    etcd_credentials: EtcdCredentials = EtcdCredentials()

    def __post_init__(self):
        check_ports(self.port, self.metrics_port)
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in 0..65535, got {self.http_port}")
        check_endpoint("--tokenizer", self.tokenizer)
        check_endpoint("--meter", self.meter)
        if self.tokenize not in TOKENIZE_MODES:
            raise ValueError(f"--tokenize must be one of {TOKENIZE_MODES}, got {self.tokenize!r}")
        for ep in self.etcd_endpoints:
            check_endpoint("--etcd-endpoints", ep)
        if self.request_timeout_seconds <= 0:
            raise ValueError("request_timeout_seconds must be > 0")
        if self.max_engine_attempts < 1:
            raise ValueError("max_engine_attempts must be >= 1")
        if not 1 <= self.spool_batch_size <= 10_000:
            raise ValueError("spool_batch_size must be in 1..10000 (the meter's batch limit)")
        if self.spool_max_backoff_seconds <= 0:
            raise ValueError("spool_max_backoff_seconds must be > 0")
        if self.quota_store not in ("memory", "off") and not self.quota_store.startswith(
                ("redis://", "rediss://", "unix://")):
            raise ValueError("--quota-store must be 'memory', 'off' or a redis://host:port/db URL,"
                             f" got {self.quota_store!r}")
        if self.quota_fail not in ("open", "closed"):
            raise ValueError(f"--quota-fail must be 'open' or 'closed', got {self.quota_fail!r}")
        if self.spool_durability not in ("process", "disk"):
            raise ValueError("spool_durability must be 'process' or 'disk'")
        if not self.spool_path or not self.snapshot_path:
            raise ValueError("spool_path and snapshot_path must be file paths")
