"""Meter settings, validated on construction (main.py is the only place that reads flags)."""
from __future__ import annotations

from dataclasses import dataclass


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
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if not self.db:
            raise ValueError("db must be a SQLite path or a postgresql:// URL")

    @property
    def postgres(self) -> bool:
        return self.db.startswith(("postgresql://", "postgres://"))
