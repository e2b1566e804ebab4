"""Prometheus /metrics over HTTP. Names follow `tokenserve_<service>_<name>_<unit>`."""
from __future__ import annotations

from prometheus_client import start_http_server


def start_metrics_server(port: int, host: str = "127.0.0.1") -> int:
    """Serves the default registry on http://host:port/metrics; port 0 picks a free one.

    Returns the bound port.
    """
    server, _thread = start_http_server(port, addr=host)
    return server.server_address[1]
