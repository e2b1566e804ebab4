"""ConfigStore against a real etcd: validation, CAS conflicts, audit in the same txn, rollback."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from controlplane import schema
from controlplane.schema import Route, Tenant, Tier, generate_api_key
from controlplane.seed import DEFAULT_MODEL, default_documents, seed
from controlplane.store import ConfigStore
from tokenserve.runtime.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from tokenserve.runtime.ports import free_port


@pytest.fixture
async def store(etcd):
    async with ConfigStore([etcd.endpoint]) as s:
        await seed(s, actor="test")
        yield s


async def test_seed_writes_only_missing_keys(store):
    assert {v.key for v in await store.list("tiers")} == {"tiers/free", "tiers/standard", "tiers/premium"}
    free = await store.require("tiers/free")
    assert free.document.requests_per_second == 10
    await store.update("tiers/free", lambda t: dataclasses.replace(t, requests_per_second=11), actor="ops")
    assert await seed(store, actor="test") == []
    assert (await store.require("tiers/free")).document.requests_per_second == 11
    seeds = [e for e in await store.audit_log() if e.action == "seed"]
    assert len(seeds) == len(default_documents())


async def test_references_are_checked(store):
    with pytest.raises(FailedPrecondition, match="tenants/acme: tier 'gold' does not exist"):
        await store.create(Tenant("acme", "Acme", "gold"), actor="ops")
    _, key = generate_api_key("ghost")
    with pytest.raises(FailedPrecondition, match="tenant 'ghost' does not exist"):
        await store.create(key, actor="ops")
    with pytest.raises(InvalidArgument, match=r"version\(s\) v9 are not in models/"):
        await store.put(Route(DEFAULT_MODEL, {"q4_1": 50, "v9": 50}), actor="ops")
    await store.create(Tenant("acme", "Acme", "free"), actor="ops")
    with pytest.raises(FailedPrecondition, match="tiers/free is still used by tenants/acme"):
        await store.delete("tiers/free", actor="ops")
    with pytest.raises(NotFound, match="tiers/gold does not exist"):
        await store.delete("tiers/gold", actor="ops")
    with pytest.raises(InvalidArgument, match="actor must name who"):
        await store.put(Tenant("acme", "Acme", "free"), actor="")


async def test_second_concurrent_writer_gets_conflict(etcd, store):
    cur = await store.require("tiers/free")
    async with ConfigStore([etcd.endpoint]) as other:
        a = dataclasses.replace(cur.document, requests_per_second=20)
        b = dataclasses.replace(cur.document, requests_per_second=30)
        results = await asyncio.gather(
            store.put(a, actor="alice", expected_revision=cur.mod_revision),
            other.put(b, actor="bob", expected_revision=cur.mod_revision), return_exceptions=True)
    conflicts = [r for r in results if isinstance(r, Conflict)]
    winners = [r for r in results if isinstance(r, int)]
    assert len(conflicts) == 1 and len(winners) == 1, results
    assert "tiers/free was changed by another writer" in conflicts[0].message
    now = await store.require("tiers/free")
    assert now.mod_revision == winners[0]
    assert now.document.requests_per_second in (20, 30)
    with pytest.raises(Conflict, match="tiers/free already exists"):
        await store.create(cur.document, actor="ops")


async def test_audit_entry_per_write_at_its_revision_under_contention(etcd, store):
    stores = [ConfigStore([etcd.endpoint]) for _ in range(6)]
    try:
        revs = await asyncio.gather(*[
            s.create(Tier(f"t{i}", 1 + i, 100, 1000, 1, 0, 16), actor=f"w{i}")
            for i, s in enumerate(stores)])
    finally:
        await asyncio.gather(*[s.close() for s in stores])
    assert len(set(revs)) == 6
    for i, rev in enumerate(revs):
        doc = await store.require(f"tiers/t{i}")
        (entry,) = await store.history(f"tiers/t{i}")
        assert entry.revision == rev == doc.mod_revision
        assert entry.actor == f"w{i}" and entry.before is None
        assert entry.after == schema.to_dict(doc.document)


async def test_rollback_restores_and_is_audited(store):
    first = (await store.require("tiers/free")).mod_revision
    r2 = await store.update("tiers/free", lambda t: dataclasses.replace(t, requests_per_second=25), actor="ops")
    await store.update("tiers/free", lambda t: dataclasses.replace(t, max_tokens=64), actor="ops")
    back = await store.rollback("tiers/free", first, actor="boss")
    doc = (await store.require("tiers/free")).document
    assert doc.requests_per_second == 10 and doc.max_tokens == 512
    hist = await store.history("tiers/free")
    assert [e.action for e in hist] == ["seed", "put", "put", "rollback"]
    last = hist[-1]
    assert last.revision == back and last.actor == "boss" and last.detail == f"to revision {first}"
    assert last.before["max_tokens"] == 64 and last.after["requests_per_second"] == 10
    await store.rollback("tiers/free", r2, actor="boss")
    assert (await store.require("tiers/free")).document.requests_per_second == 25
    with pytest.raises(InvalidArgument, match="in the future"):
        await store.rollback("tiers/free", 10**9, actor="boss")


async def test_rollback_of_a_created_key_deletes_it(store):
    before = await store.revision()
    await store.create(Tier("gold", 5, 100, 1000, 1, 0, 16), actor="ops")
    await store.rollback("tiers/gold", before, actor="ops")
    assert await store.get("tiers/gold") is None
    assert [e.action for e in await store.history("tiers/gold")] == ["create", "rollback"]


async def test_unreachable_etcd_is_unavailable_with_endpoint():
    endpoint = f"127.0.0.1:{free_port()}"
    async with ConfigStore([endpoint], timeout=2) as s:
        with pytest.raises(Unavailable, match=f"etcd at {endpoint} is unreachable"):
            await s.get("tiers/free")


async def test_second_endpoint_is_used_when_first_is_down(etcd):
    dead = f"127.0.0.1:{free_port()}"
    async with ConfigStore([dead, etcd.endpoint], timeout=2) as s:
        assert await s.get("tiers/free") is None
        assert s.client.endpoint == etcd.endpoint


async def test_audit_entry_follows_a_write_that_lands_on_a_later_revision(store):
    """An unrelated write between our read and our txn moves our revision; the entry follows."""
    real_range = store.client.range
    sneaked = []

    async def range_then_sneak_a_write(key, *args, **kw):
        resp = await real_range(key, *args, **kw)
        if key == b"/tokenserve/v1/tiers/gold" and not sneaked:
            sneaked.append((await store.client.put(b"/elsewhere/x", b"1")).header.revision)
        return resp

    store.client.range = range_then_sneak_a_write
    try:
        rev = await store.create(Tier("gold", 5, 100, 1000, 1, 0, 16), actor="ops")
    finally:
        store.client.range = real_range
    assert sneaked and rev == sneaked[0] + 1
    (entry,) = await store.history("tiers/gold")
    assert entry.revision == rev == (await store.require("tiers/gold")).mod_revision
    assert [e.revision for e in await store.audit_log()] == sorted({e.revision for e in await store.audit_log()})
