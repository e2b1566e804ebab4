"""Meter settings, validated on construction (main.py is the only place that reads flags)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from controlplane.etcd_client import EtcdCredentials
from services.meter.usage import DEFAULT_MAX_AGE_SECONDS, DEFAULT_MAX_AHEAD_SECONDS
from tokenserve.runtime.config import check_ports
from tokenserve.runtime.service_token import check_token
from tokenserve.runtime.tls import PLAINTEXT, TlsConfig


@dataclass(frozen=True)
class MeterConfig:
    host: str = "127.0.0.1"
    port: int = 50054
    # None: no /metrics endpoint; 0: any free port.
    metrics_port: int | None = 9104
    # A SQLite file path, or a postgresql:// URL for a ledger shared by several replicas.
    db: str = "var/meter.db"
    # Accepted finish times of recorded events, relative to the meter's clock.
    max_age_seconds: float = DEFAULT_MAX_AGE_SECONDS
    max_ahead_seconds: float = DEFAULT_MAX_AHEAD_SECONDS
    # With etcd, events of a tenant that is not configured are refused; without, not checked.
    etcd_endpoints: tuple[str, ...] = ()
    config_snapshot: Path | None = None
    # The meter's own reconcile (drift.py): every interval (0: never) over the last window.
    reconcile_interval_seconds: float = 60.0
    reconcile_window_seconds: float = 3600.0
    log_level: str = "info"
    # Set: every MeterService call needs `authorization: Bearer <token>` (service_token).
    token: str | None = field(default=None, repr=False)
    # TLS of its listeners and of the channels it opens (tokenserve.runtime.tls).
    tls: TlsConfig = PLAINTEXT
    # How it reaches etcd: TLS, client certificate, user/password (controlplane.etcd_client).
    etcd_credentials: EtcdCredentials = EtcdCredentials()

    def __post_init__(self):
        check_ports(self.port, self.metrics_port)
        if self.token is not None:
            check_token(self.token)
        if not self.db:
            raise ValueError("db must be a SQLite path or a postgresql:// URL")
        if not self.max_age_seconds > 0 or not self.max_ahead_seconds >= 0:
            raise ValueError("max_age_seconds must be > 0 and max_ahead_seconds >= 0")
        if not self.reconcile_interval_seconds >= 0 or not self.reconcile_window_seconds > 0:
            raise ValueError("reconcile_interval_seconds must be >= 0 (0: off) and"
                             " reconcile_window_seconds > 0")

    @property
    def postgres(self) -> bool:
        return self.db.startswith(("postgresql://", "postgres://"))
