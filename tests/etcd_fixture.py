"""A real etcd for tests, on free ports in a temporary folder.

Two fixtures: `etcd` (one fresh etcd per test) and `etcd_session` (one etcd for the whole
session; call `.clear()` at the start of a test that needs an empty keyspace). Use them from any
test folder's conftest.py:

    from tests.etcd_fixture import etcd, etcd_session  # noqa: F401  (pytest fixtures)

The yielded `EtcdHandle` has `.endpoint` ("127.0.0.1:port"), `.stop()`, `.start()`, `.kill()`,
`.restart()` and `.clear()`.
"""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from aetcd import rpc

from controlplane.etcd_local import EtcdProcess
from tokenserve.runtime.ports import free_port


class EtcdHandle:
    def __init__(self, data_dir: Path):
        self.process = EtcdProcess(data_dir, free_port(), free_port(), unsafe_no_fsync=True)

    @property
    def endpoint(self) -> str:
        return self.process.endpoint

    def start(self) -> None:
        self.process.start()

    def stop(self) -> None:
        self.process.stop()

    def kill(self) -> None:
        self.process.kill()

    def restart(self) -> None:
        self.process.restart()

    def clear(self, prefix: bytes = b"/tokenserve/") -> None:
        """Deletes every key under `prefix` (for a shared, session-wide etcd)."""
        end = bytearray(prefix)
        end[-1] += 1
        with grpc.insecure_channel(self.endpoint) as ch:
            rpc.KVStub(ch).DeleteRange(rpc.DeleteRangeRequest(key=prefix, range_end=bytes(end)),
                                       timeout=5)


@pytest.fixture
def etcd(tmp_path):
    handle = EtcdHandle(tmp_path / "etcd")
    handle.start()
    try:
        yield handle
    finally:
        handle.kill()


@pytest.fixture(scope="session")
def etcd_session(tmp_path_factory):
    handle = EtcdHandle(tmp_path_factory.mktemp("etcd-session") / "etcd")
    handle.start()
    try:
        yield handle
    finally:
        handle.kill()
