"""tsctl end to end, as an operator runs it: a subprocess against a real etcd."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from controlplane.schema import hash_api_key
from controlplane.seed import seed
from controlplane.store import ConfigStore
from tokenserve.runtime.ports import free_port

pytestmark = pytest.mark.slow  # each test runs tsctl as several subprocesses


def tsctl(endpoint: str, *args: str, actor: str = "tester") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controlplane.tsctl", "--endpoints", endpoint,
                           "--actor", actor, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
async def seeded(etcd):
    async with ConfigStore([etcd.endpoint]) as s:
        await seed(s, actor="test")
    return etcd.endpoint


async def raw_values(endpoint: str) -> list[bytes]:
    async with ConfigStore([endpoint]) as s:
        prefix = b"/tokenserve/"
        resp = await s.client.range(prefix, b"/tokenserve0")
        return [kv.key + b"=" + kv.value for kv in resp.kvs]


async def test_tenant_and_key_lifecycle(seeded):
    ep = seeded
    r = await asyncio.to_thread(tsctl, ep, "tenant", "create", "acme", "--name", "Acme Corp", "--tier", "standard")
    assert r.returncode == 0, r.stderr
    r = await asyncio.to_thread(tsctl, ep, "--json", "key", "issue", "acme")
    assert r.returncode == 0, r.stderr
    issued = json.loads(r.stdout)
    key = issued["key"]
    assert key.startswith("ts-") and issued["display_prefix"] == key[:10]
    assert issued["key_hash"] == hash_api_key(key)

    stored = b"\n".join(await raw_values(ep))
    assert key.encode() not in stored  # etcd holds only the hash
    assert hash_api_key(key).encode() in stored

    r = await asyncio.to_thread(tsctl, ep, "key", "list")
    assert r.returncode == 0 and key[:10] in r.stdout and key not in r.stdout
    r = await asyncio.to_thread(tsctl, ep, "--json", "key", "list")
    (row,) = json.loads(r.stdout)
    assert row["prefix"] == key[:10] and row["revoked"] is False and key not in r.stdout

    r = await asyncio.to_thread(tsctl, ep, "key", "revoke", key[:10])
    assert r.returncode == 0, r.stderr
    r = await asyncio.to_thread(tsctl, ep, "key", "revoke", key[:10])
    assert r.returncode == 1 and "already revoked" in r.stderr
    r = await asyncio.to_thread(tsctl, ep, "--json", "tenant", "show", "acme")
    shown = json.loads(r.stdout)
    assert shown["tier"] == "standard" and shown["keys"][0]["revoked"] is True

    r = await asyncio.to_thread(tsctl, ep, "tenant", "disable", "acme", actor="alice")
    assert r.returncode == 0
    r = await asyncio.to_thread(tsctl, ep, "--json", "history", "tenants/acme")
    assert [(e["action"], e["actor"]) for e in json.loads(r.stdout)] == [("create", "tester"), ("disable", "alice")]


async def test_exit_codes_and_messages(seeded):
    ep = seeded
    r = await asyncio.to_thread(tsctl, ep, "tenant", "create", "x", "--tier", "gold")
    assert r.returncode == 1 and "tier 'gold' does not exist" in r.stderr
    r = await asyncio.to_thread(tsctl, ep, "tier", "set", "free", "--rps", "-1")
    assert r.returncode == 2 and "tiers/free: requests_per_second must be > 0, got -1" in r.stderr
    r = await asyncio.to_thread(tsctl, ep, "tenant", "show", "nobody")
    assert r.returncode == 1 and "tenants/nobody does not exist" in r.stderr
    r = await asyncio.to_thread(tsctl, ep, "tenant", "frobnicate")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = await asyncio.to_thread(tsctl, ep, "route", "set", "smollm2-135m-instruct", "q4_1=lots")
    assert r.returncode == 2 and "q4_1: expected a number" in r.stderr
    for out in (r.stdout, r.stderr):
        assert "Traceback" not in out


async def test_unreachable_etcd_is_a_clear_error():
    dead = f"127.0.0.1:{free_port()}"
    r = await asyncio.to_thread(tsctl, dead, "tenant", "list")
    assert r.returncode == 1
    assert f"etcd at {dead} is unreachable" in r.stderr and "--endpoints" in r.stderr
    assert "Traceback" not in r.stderr


async def test_tier_route_and_rollback(seeded):
    ep = seeded
    r = await asyncio.to_thread(tsctl, ep, "--json", "tier", "set", "free", "--rps", "25")
    rev_changed = json.loads(r.stdout)["revision"]
    r = await asyncio.to_thread(tsctl, ep, "--json", "history", "tiers/free")
    seeded_rev = json.loads(r.stdout)[0]["revision"]
    assert json.loads(r.stdout)[-1]["revision"] == rev_changed
    r = await asyncio.to_thread(tsctl, ep, "rollback", "tiers/free", "--to-revision", str(seeded_rev))
    assert r.returncode == 0, r.stderr
    r = await asyncio.to_thread(tsctl, ep, "--json", "tier", "show", "free")
    assert json.loads(r.stdout)[0]["requests_per_second"] == 10

    model = "smollm2-135m-instruct"
    r = await asyncio.to_thread(tsctl, ep, "model", "set", model, "q8_0", "--artifact", "/m/q8.gguf",
                                "--max-context", "2048")
    assert r.returncode == 0, r.stderr
    r = await asyncio.to_thread(tsctl, ep, "--json", "route", "canary", model, "q8_0", "10")
    assert json.loads(r.stdout)["versions"] == {"q4_1": 90, "q8_0": 10}
    r = await asyncio.to_thread(tsctl, ep, "--json", "route", "rollback", model)
    assert json.loads(r.stdout)["versions"] == {"q4_1": 100}
    r = await asyncio.to_thread(tsctl, ep, "route", "canary", model, "v9", "10")
    assert r.returncode == 2 and "v9" in r.stderr
    r = await asyncio.to_thread(tsctl, ep, "status")
    assert r.returncode == 0 and "config revision" in r.stdout


async def test_watch_prints_changes(seeded):
    ep = seeded
    proc = subprocess.Popen([sys.executable, "-m", "controlplane.tsctl", "--endpoints", ep, "--json",
                             "watch", "--count", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        first = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert json.loads(first)["event"] == "synced"
        r = await asyncio.to_thread(tsctl, ep, "tier", "set", "premium", "--max-tokens", "8000")
        assert r.returncode == 0, r.stderr
        line = json.loads(await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60))
        assert line["key"] == "tiers/premium" and line["event"] == "updated"
        assert line["document"]["max_tokens"] == 8000
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()


async def test_status_lists_registrations_with_their_lease(seeded):
    from controlplane.registry import register
    from controlplane.schema import EngineRegistration

    ep = seeded
    handle = await register([ep], "engines",
                            EngineRegistration("engine-0", "127.0.0.1:50999", "smollm2-135m-instruct",
                                               "q4_1", 64), ttl=30)
    try:
        r = await asyncio.to_thread(tsctl, ep, "--json", "status")
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        (engine,) = st["engines"]
        assert engine["id"] == "engine-0" and 0 < engine["lease_ttl"] <= 30
        assert st["gateways"] == [] and st["last_change"]["action"] == "seed"
        r = await asyncio.to_thread(tsctl, ep, "status")
        assert "engine-0" in r.stdout and "127.0.0.1:50999" in r.stdout
    finally:
        await handle.close()
