"""Guarded canaries against a real etcd: tsctl writes the guard, promote ends a rollout, and
gateways' rollbacks are one audited transaction however many race."""
from __future__ import annotations

import asyncio
import json

from controlplane import admin
from controlplane.schema import ModelSpec, ModelVersion, Route
from controlplane.store import ConfigStore
from tests.integration.controlplane.test_tsctl import tsctl

MODEL = "m"


async def setup(endpoint: str) -> None:
    async with ConfigStore([endpoint]) as s:
        await s.create(ModelSpec(MODEL, {"a": ModelVersion("/a", 64), "b": ModelVersion("/b", 64)},
                                 "a"), actor="test")
        await s.create(Route(MODEL, {"a": 100}), actor="test")


async def test_tsctl_canary_with_a_guard_then_promote(etcd):
    await setup(etcd.endpoint)
    r = await asyncio.to_thread(tsctl, etcd.endpoint, "route", "canary", MODEL, "b", "20",
                                "--max-error-rate", "0.05", "--max-ttft-p99", "2.5",
                                "--window", "30", "--min-requests", "10")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"routes/{MODEL}: a=80 b=20 (revision {r.stdout.split('revision ')[1].split(')')[0]})",
        "  guard: b: error rate <= 0.05 and ttft p99 <= 2.5s over 30s (min 10 requests),"
        " else back to a"]
    # Ramping up keeps the guard; the audit entry says what was asked.
    r = await asyncio.to_thread(tsctl, etcd.endpoint, "--json", "route", "canary", MODEL, "b", "50")
    doc = json.loads(r.stdout)
    assert doc["versions"] == {"a": 50, "b": 50} and doc["canary"]["stable"] == "a"
    assert doc["canary"]["window_seconds"] == 30
    r = await asyncio.to_thread(tsctl, etcd.endpoint, "route", "show")
    assert "b: error rate <= 0.05" in r.stdout
    r = await asyncio.to_thread(tsctl, etcd.endpoint, "--json", "route", "promote", MODEL, "b")
    doc = json.loads(r.stdout)
    assert doc["versions"] == {"a": 0, "b": 100} and "canary" not in doc
    r = await asyncio.to_thread(tsctl, etcd.endpoint, "--json", "history", f"routes/{MODEL}")
    actions = [(e["action"], e["detail"]) for e in json.loads(r.stdout)]
    assert actions[-1] == ("promote", "b -> 100%")
    assert actions[-3][1].startswith("b -> 20%; guard b: error rate <= 0.05")
    # A limit out of range is refused before anything is written.
    r = await asyncio.to_thread(tsctl, etcd.endpoint, "route", "canary", MODEL, "a", "10",
                                "--max-error-rate", "2")
    assert r.returncode == 2 and "canary.max_error_rate must be < 1" in r.stderr


async def test_racing_rollbacks_make_one_audited_change(etcd):
    await setup(etcd.endpoint)
    async with ConfigStore([etcd.endpoint]) as s:
        await admin.route_canary(s, MODEL, "b", 30, actor="ops",
                                 limits=admin.GuardLimits(max_error_rate=0.1))
        stores = [ConfigStore([etcd.endpoint]) for _ in range(4)]
        try:
            results = await asyncio.gather(*(
                admin.roll_back_canary(st, MODEL, "b", f"breach seen by gateway {i}",
                                       actor=f"gateway:g{i}") for i, st in enumerate(stores)))
        finally:
            for st in stores:
                await st.close()
        assert sum(r is not None for r in results) == 1
        route = (await s.require(f"routes/{MODEL}")).document
        assert dict(route.versions) == {"a": 100, "b": 0} and route.canary is None
        rollbacks = [e for e in await s.history(f"routes/{MODEL}")
                     if e.action == "canary-rollback"]
        assert len(rollbacks) == 1 and rollbacks[0].detail.startswith("breach seen by gateway")
        # Seen again later (a slow gateway): nothing to do.
        assert await admin.roll_back_canary(s, MODEL, "b", "late", actor="gateway:g9") is None
