"""Lease-bound registrations: present while alive, gone within the TTL after a kill."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
import structlog.testing

from controlplane.registry import register, register_with_retry
from controlplane.schema import EngineRegistration, GatewayRegistration
from controlplane.store import ConfigStore
from controlplane.watcher import ConfigWatcher
from tokenserve.runtime.errors import InvalidArgument


async def wait_until(pred, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.05)


async def test_killed_process_registration_disappears_within_ttl(etcd):
    watcher = ConfigWatcher([etcd.endpoint], heartbeat=0.5)
    await watcher.start()
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.controlplane.register_child",
                             etcd.endpoint, "engine-7", "2"], stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.strip() == "registered"
        await wait_until(lambda: "engine-7" in watcher.snapshot.engines, 10)
        assert watcher.snapshot.engines_for("smollm2-135m-instruct", "q4_1")[0].id == "engine-7"
        await asyncio.sleep(3)  # longer than the TTL: the keep-alives must hold it
        assert "engine-7" in watcher.snapshot.engines
        proc.kill()
        proc.wait(10)
        t0 = time.monotonic()
        await wait_until(lambda: "engine-7" not in watcher.snapshot.engines, 30)
        print(f"\nkilled engine gone after {time.monotonic() - t0:.1f} s (ttl 2 s)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        await watcher.close()


async def test_close_revokes_at_once_and_bad_input(etcd):
    handle = await register([etcd.endpoint], "gateways", GatewayRegistration("gw-1", "127.0.0.1:50051"), ttl=30)
    async with ConfigStore([etcd.endpoint]) as store:
        assert (await store.require("gateways/gw-1")).document.endpoint == "127.0.0.1:50051"
        await handle.close()
        assert await store.get("gateways/gw-1") is None
    with pytest.raises(InvalidArgument, match="kind must be one of engines, gateways"):
        await register([etcd.endpoint], "tiers", GatewayRegistration("gw-1", "127.0.0.1:1"))
    with pytest.raises(InvalidArgument, match="engines needs a EngineRegistration"):
        await register([etcd.endpoint], "engines", GatewayRegistration("gw-1", "127.0.0.1:1"))
    with pytest.raises(InvalidArgument, match="ttl must be an integer >= 2"):
        await register([etcd.endpoint], "engines",
                       EngineRegistration("e", "127.0.0.1:1", "m", "v", 1), ttl=0)


async def test_registration_returns_after_etcd_restart(etcd):
    handle = await register([etcd.endpoint], "engines",
                            EngineRegistration("e1", "127.0.0.1:9", "m", "v", 1), ttl=2)
    try:
        etcd.stop()
        await asyncio.sleep(3)
        etcd.start()
        async with ConfigStore([etcd.endpoint]) as store:
            deadline = time.monotonic() + 20
            while await store.get("engines/e1") is None:
                assert time.monotonic() < deadline, "registration did not come back"
                await asyncio.sleep(0.1)
            await asyncio.sleep(3)  # and it stays (the keep-alives run on the new lease)
            assert await store.get("engines/e1") is not None
    finally:
        await handle.close()


async def failures_logged(logs: list[dict], count: int, timeout: float = 30) -> list[dict]:
    await wait_until(lambda: sum(e["event"] == "registration_failed" for e in logs) >= count,
                     timeout)
    return [e for e in logs if e["event"] == "registration_failed"]


async def test_retrying_registration_waits_for_etcd_then_registers(etcd):
    with pytest.raises(InvalidArgument, match="kind must be one of"):  # bad input: no retries
        await register_with_retry([etcd.endpoint], "tiers", GatewayRegistration("g", "h:1"))
    etcd.stop()
    reg = EngineRegistration("e-late", "127.0.0.1:9", "m", "v", 1)
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(register_with_retry([etcd.endpoint], "engines", reg, ttl=2,
                                                       first_delay=0.05, max_delay=0.2))
        failed = await failures_logged(logs, 2)
        assert not task.done()
        assert failed[0]["key"] == "engines/e-late" and failed[0]["retry_in"] > 0
        etcd.start()
        handle = await asyncio.wait_for(task, 30)
    try:
        async with ConfigStore([etcd.endpoint]) as store:
            assert (await store.require("engines/e-late")).document.endpoint == "127.0.0.1:9"
    finally:
        await handle.close()


async def test_retrying_registration_cancelled_leaves_nothing(etcd):
    etcd.stop()
    reg = EngineRegistration("e-gone", "127.0.0.1:9", "m", "v", 1)
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(register_with_retry([etcd.endpoint], "engines", reg, ttl=2,
                                                       first_delay=0.05, max_delay=0.2))
        await failures_logged(logs, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    etcd.start()
    async with ConfigStore([etcd.endpoint]) as store:
        assert await store.get("engines/e-gone") is None
