"""etcd with authentication on: the store and watcher log in; wrong credentials are refused."""
from __future__ import annotations

import grpc
import pytest
from aetcd import rpc

from controlplane.schema import Tier
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
