"""Checks shared by every service's frozen config dataclass."""
from __future__ import annotations

import re

from tokenserve.runtime.tls import add_tls_args

_ENDPOINT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})$")


def check_ports(port: int, metrics_port: int | None) -> None:
    """A gRPC port and an optional metrics port (None: no /metrics), each 0..65535 (0: any)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    if metrics_port is not None and not 0 <= metrics_port <= 65535:
        raise ValueError(f"metrics_port must be in 0..65535, got {metrics_port}")


def check_endpoint(what: str, value: str) -> None:
    """host:port (an IPv6 host in brackets) with a port in 1..65535."""
    m = _ENDPOINT_RE.match(value)
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"{what} must be host:port with a port in 1-65535, got {value!r}")


def _metrics_port(value: str) -> int | None:
    port = int(value)
    return None if port < 0 else port


def add_server_args(parser, *, port: int, metrics_port: int) -> None:
    """--host, --port, --metrics-port (-1: no /metrics, parsed as None; 0: any free port) and
    the TLS flags (tokenserve.runtime.tls; read them with tls_from_args)."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--metrics-port", type=_metrics_port, default=metrics_port,
                        help="Prometheus /metrics port; -1 disables it, 0 picks a free one")
    add_tls_args(parser)
