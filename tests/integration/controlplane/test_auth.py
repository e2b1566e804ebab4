"""etcd with authentication on: the store and watcher log in; wrong credentials are refused."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import structlog.testing
from aetcd import rpc

from controlplane.registry import register_with_retry
from controlplane.schema import GatewayRegistration, Tier
from controlplane.store import ConfigStore
from controlplane.watcher import ConfigWatcher
from tokenserve.runtime.errors import Unauthenticated


def enable_auth(endpoint: str, password: str) -> None:
    with grpc.insecure_channel(endpoint) as ch:
        auth = rpc.AuthStub(ch)
        auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=password), timeout=5)
        auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
        auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)


async def test_user_password_round_trip(etcd):
    enable_auth(etcd.endpoint, "s3cret")
    async with ConfigStore([etcd.endpoint], user="root", password="s3cret") as store:
        rev = await store.create(Tier("free", 10, 100, 1000, 1, 0, 16), actor="ops")
    w = ConfigWatcher([etcd.endpoint], user="root", password="s3cret")
    try:
        snap = await w.start()
        assert snap.revision >= rev and "free" in snap.tiers
    finally:
        await w.close()
    async with ConfigStore([etcd.endpoint], user="root", password="wrong") as store:
        with pytest.raises(Unauthenticated, match="refused the credentials"):
            await store.get("tiers/free")
    async with ConfigStore([etcd.endpoint]) as store:  # no credentials at all
        with pytest.raises(Unauthenticated):
            await store.get("tiers/free")


async def test_refused_registration_is_retried_and_logged_without_the_password(etcd):
    enable_auth(etcd.endpoint, "s3cret")
    reg = GatewayRegistration("gw-auth", "127.0.0.1:50051")
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(register_with_retry(
            [etcd.endpoint], "gateways", reg, user="root", password="wr0ng-pa55",
            first_delay=0.05, max_delay=0.2))
        deadline = time.monotonic() + 30
        while sum(e["event"] == "registration_failed" for e in logs) < 2:
            assert time.monotonic() < deadline, f"no retried failure logged: {logs}"
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    failed = [e for e in logs if e["event"] == "registration_failed"]
    assert "credentials" in failed[0]["error"]
    assert "wr0ng-pa55" not in repr(logs) and "s3cret" not in repr(logs)
    async with ConfigStore([etcd.endpoint], user="root", password="s3cret") as store:
        assert await store.get("gateways/gw-auth") is None
