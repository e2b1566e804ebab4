"""Checks shared by every service's frozen config dataclass."""
from __future__ import annotations


def check_ports(port: int, metrics_port: int | None) -> None:
    """A gRPC port and an optional metrics port (None: no /metrics), each 0..65535 (0: any)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    if metrics_port is not None and not 0 <= metrics_port <= 65535:
        raise ValueError(f"metrics_port must be in 0..65535, got {metrics_port}")
