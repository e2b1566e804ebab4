"""Meter settings, validated on construction (main.py is the only place that reads flags)."""
from __future__ import annotations

from dataclasses import dataclass
from tokenserve.runtime.config import check_ports


@dataclass(frozen=True)
class MeterConfig:
    host: str = "127.0.0.1"
    port: int = 50054
    # None: no /metrics endpoint; 0: any free port.
    metrics_port: int | None = 9104
    # A SQLite file path, or a postgresql:// URL for a ledger shared by several replicas.
    db: str = "var/meter.db"
    log_level: str = "info"

    def __post_init__(self):
        check_ports(self.port, self.metrics_port)
        if not self.db:
            raise ValueError("db must be a SQLite path or a postgresql:// URL")

    @property
    def postgres(self) -> bool:
        return self.db.startswith(("postgresql://", "postgres://"))
