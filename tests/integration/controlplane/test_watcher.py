"""ConfigWatcher against a real etcd: live changes, outages, compaction, snapshot file."""
from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time

import pytest
from prometheus_client import CollectorRegistry

from controlplane.etcd_client import EtcdClient, EtcdOptions
from controlplane.schema import Tenant, generate_api_key
from controlplane.seed import seed
from controlplane.store import ConfigStore
from controlplane.watcher import ConfigWatcher
from tokenserve.runtime.errors import Unavailable
from tokenserve.runtime.ports import free_port
from tests.integration.controlplane.tcp_proxy import TcpProxy


@pytest.fixture
async def store(etcd):
    async with ConfigStore([etcd.endpoint]) as s:
        await seed(s, actor="test")
        await s.create(Tenant("acme", "Acme", "free"), actor="test")
        yield s


@pytest.fixture
async def watcher(etcd, store, tmp_path):
    w = ConfigWatcher([etcd.endpoint], snapshot_path=tmp_path / "snap.json", heartbeat=0.5)
    await w.start()
    yield w
    await w.close()


def raise_rps(value):
    return lambda t: dataclasses.replace(t, requests_per_second=value)


async def test_tier_change_reaches_running_watcher_and_metrics(etcd, store, tmp_path):
    registry = CollectorRegistry()
    w = ConfigWatcher([etcd.endpoint], snapshot_path=tmp_path / "s.json", service="gateway",
                      registry=registry)
    try:
        snap = await w.start()
        assert snap.tiers["free"].requests_per_second == 10
        seen = []
        w.on_change(lambda s: seen.append(s.revision))
        rev = await store.update("tiers/free", raise_rps(42), actor="ops")
        snap = await w.wait_for_revision(rev, timeout=10)
        assert snap.revision == rev and snap.tiers["free"].requests_per_second == 42
        assert seen and seen[-1] == rev
        assert registry.get_sample_value("tokenserve_gateway_config_revision") == rev
        assert registry.get_sample_value("tokenserve_gateway_config_seconds_since_sync") < 60
        assert '"requests_per_second": 42' in (tmp_path / "s.json").read_text()
    finally:
        await w.close()


async def test_revoked_key_refused_within_a_second(store, watcher):
    key, record = generate_api_key("acme")
    rev = await store.create(record, actor="ops")
    await watcher.wait_for_revision(rev, timeout=10)
    assert watcher.snapshot.authenticate(key) is not None
    t0 = time.perf_counter()
    rev = await store.update(record.key, lambda k: dataclasses.replace(k, revoked=True), actor="ops")
    await watcher.wait_for_revision(rev, timeout=10)
    elapsed = time.perf_counter() - t0
    assert watcher.snapshot.authenticate(key) is None
    print(f"\nrevoke -> refused in {elapsed * 1000:.1f} ms")


async def test_change_to_applied_latency(store, watcher):
    """Measures put -> callback latency over many changes (reported, not asserted)."""
    applied: dict[int, float] = {}
    watcher.on_change(lambda s: applied.setdefault(s.revision, time.perf_counter()))
    lat = []
    for i in range(40):
        t0 = time.perf_counter()
        rev = await store.update("tiers/free", raise_rps(100 + i), actor="ops")
        await watcher.wait_for_revision(rev, timeout=10)
        lat.append(applied[rev] - t0)
    lat.sort()
    p50, p99 = statistics.median(lat), lat[int(0.99 * (len(lat) - 1))]
    print(f"\nchange->applied latency over {len(lat)} changes: p50 {p50 * 1000:.1f} ms, "
          f"p99 {p99 * 1000:.1f} ms, max {lat[-1] * 1000:.1f} ms")
    assert watcher.snapshot.tiers["free"].requests_per_second == 139


async def test_compaction_while_watch_is_disconnected(etcd, store, tmp_path):
    host, port = etcd.endpoint.split(":")
    proxy = await TcpProxy(host, int(port)).start()
    w = ConfigWatcher([proxy.endpoint], snapshot_path=tmp_path / "snap.json", heartbeat=0.3, timeout=1)
    try:
        await w.start()
        before = w.snapshot.revision
        proxy.cut()
        for i in range(3):
            last = await store.update("tiers/free", raise_rps(60 + i), actor="ops")
        await store.delete("tenants/acme", actor="ops")
        last = await store.revision()
        client = EtcdClient(EtcdOptions.of(etcd.endpoint))
        await client.compact(last)
        await client.close()
        assert w.snapshot.revision == before  # still the old config while partitioned
        proxy.restore()
        snap = await w.wait_for_revision(last, timeout=20)
        assert snap.tiers["free"].requests_per_second == 62
        assert "acme" not in snap.tenants
    finally:
        await w.close()
        await proxy.close()


async def test_etcd_killed_keeps_last_good_then_catches_up(etcd, store, watcher):
    key, record = generate_api_key("acme")
    rev = await store.create(record, actor="ops")
    await watcher.wait_for_revision(rev, timeout=10)
    etcd.kill()
    await asyncio.sleep(1.0)  # let the watcher notice the outage
    assert watcher.snapshot.authenticate(key) is not None  # still serving the last good policy
    assert watcher.snapshot.tiers["free"].requests_per_second == 10
    etcd.start()
    async with ConfigStore([etcd.endpoint]) as s2:
        rev = await s2.update("tiers/free", raise_rps(77), actor="ops")
    snap = await watcher.wait_for_revision(rev, timeout=30)
    assert snap.tiers["free"].requests_per_second == 77 and snap.authenticate(key) is not None


async def test_start_with_etcd_down_uses_snapshot_file_then_catches_up(etcd, store, tmp_path):
    path = tmp_path / "gateway.json"
    key, record = generate_api_key("acme")
    await store.create(record, actor="ops")
    first = ConfigWatcher([etcd.endpoint], snapshot_path=path)
    await first.start()
    await first.close()
    etcd.stop()
    w = ConfigWatcher([etcd.endpoint], snapshot_path=path, heartbeat=0.3, timeout=1)
    try:
        snap = await w.start()
        assert snap.source == "file" and snap.authenticate(key) is not None
        etcd.start()
        async with ConfigStore([etcd.endpoint]) as s2:
            rev = await s2.update("tiers/free", raise_rps(33), actor="ops")
        snap = await w.wait_for_revision(rev, timeout=30)
        assert snap.source == "etcd" and snap.tiers["free"].requests_per_second == 33
    finally:
        await w.close()


async def test_start_with_no_etcd_and_no_snapshot_refuses(tmp_path):
    w = ConfigWatcher([f"127.0.0.1:{free_port()}"], snapshot_path=tmp_path / "missing.json", timeout=1)
    with pytest.raises(Unavailable, match="Refusing to start without policy"):
        await w.start()
    assert not (tmp_path / "missing.json").exists()


async def test_invalid_document_written_around_the_schema_keeps_previous(etcd, store, watcher):
    client = EtcdClient(EtcdOptions.of(etcd.endpoint))
    resp = await client.put(b"/tokenserve/v1/tiers/free", b'{"name": "free", "requests_per_second": -5}')
    await client.close()
    await watcher.wait_for_revision(resp.header.revision, timeout=10)
    assert watcher.snapshot.tiers["free"].requests_per_second == 10


async def test_close_during_a_burst_of_changes_returns(etcd, store):
    """close() must end the loop even when a cancel races an arriving event."""
    stop = asyncio.Event()

    async def churn():
        i = 0
        while not stop.is_set():
            i += 1
            await store.update("tiers/free", raise_rps(200 + i % 50), actor="ops")

    writer = asyncio.create_task(churn())
    try:
        for _ in range(8):
            w = ConfigWatcher([etcd.endpoint], heartbeat=0.2)
            await w.start()
            await asyncio.sleep(0.2)
            await asyncio.wait_for(w.close(), 10)
            assert w._task is None
    finally:
        stop.set()
        await writer
