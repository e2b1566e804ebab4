from pathlib import Path

from controlplane.service_process import ServiceProcess
from tests.etcd_fixture import etcd  # noqa: F401  (pytest fixture)
from tokenserve.runtime.ports import free_port


def engine_process(log_path: Path, *args: str, metrics_port: int | None = None) -> ServiceProcess:
    """The engine on ephemeral ports with a small batch and KV cache; `args` are added."""
    port = free_port()
    metrics_port = free_port() if metrics_port is None else metrics_port
    return ServiceProcess("services.engine", [
        "--port", str(port), "--metrics-port", str(metrics_port), "--max-concurrency", "16",
        "--max-batched-tokens", "128", "--kv-cache-mb", "32", *args], port, log_path=log_path)
