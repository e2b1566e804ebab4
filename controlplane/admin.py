"""Admin operations over a `ConfigStore`: what `tsctl` does, importable (the launcher issues
its demo key with `issue_key`). Each write is audited under `actor` and refuses to overwrite a
concurrent change (`Conflict`).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import time
from typing import Any, Mapping

from controlplane import schema
from controlplane.schema import (ApiKey, Degradation, DegradationThresholds, ModelSpec, ModelVersion,
                                 PowerBudget, Route, Tenant, Tier)
from controlplane.store import ConfigStore, Versioned
from tokenserve.runtime.errors import FailedPrecondition, InvalidArgument, NotFound

# -- tenants -----------------------------------------------------------------------------------


async def create_tenant(store: ConfigStore, tenant_id: str, name: str, tier: str, *, actor: str,
                        enabled: bool = True) -> int:
    return await store.create(Tenant(tenant_id, name, tier, enabled), actor=actor)


async def set_tenant_enabled(store: ConfigStore, tenant_id: str, enabled: bool, *, actor: str) -> int:
    return await store.update(f"tenants/{tenant_id}",
                              lambda t: dataclasses.replace(t, enabled=enabled), actor=actor,
                              action="enable" if enabled else "disable")


async def set_tenant_tier(store: ConfigStore, tenant_id: str, tier: str, *, actor: str) -> int:
    return await store.update(f"tenants/{tenant_id}", lambda t: dataclasses.replace(t, tier=tier),
                              actor=actor)


async def set_tenant_overrides(store: ConfigStore, tenant_id: str, values: Mapping[str, float], *,
                               clear: tuple[str, ...] = (), clear_all: bool = False, actor: str) -> int:
    """Sets per-tenant tier limits (`values`) and removes those named in `clear`."""
    def change(t: Tenant) -> Tenant:
        merged = {} if clear_all else {k: v for k, v in t.overrides.items() if k not in clear}
        merged.update(values)
        return dataclasses.replace(t, overrides=merged)
    return await store.update(f"tenants/{tenant_id}", change, actor=actor, action="override")


# -- keys --------------------------------------------------------------------------------------


async def issue_key(store: ConfigStore, tenant_id: str, *, actor: str) -> tuple[str, ApiKey, int]:
    """(full key, stored record, revision). The full key exists only in this return value."""
    tenant = await store.get(f"tenants/{tenant_id}")
    if tenant is None:
        raise NotFound(f"tenants/{tenant_id} does not exist; create it first (tsctl tenant create)")
    key, record = schema.generate_api_key(tenant_id)
    revision = await store.create(record, actor=actor, action="issue")
    return key, record, revision


async def find_key(store: ConfigStore, ident: str) -> Versioned:
    """A key by its sha256 hash, its display prefix, or the full key itself."""
    if ident.startswith(schema.KEY_PREFIX) and len(ident) > schema.DISPLAY_PREFIX_CHARS:
        ident = schema.hash_api_key(ident)
    if len(ident) == 64:
        return await store.require(f"keys/{ident}")
    matches = [v for v in await store.list("keys") if v.document.display_prefix == ident]
    if not matches:
        raise NotFound(f"no key with prefix or hash {ident!r} (tsctl key list shows them)")
    if len(matches) > 1:
        hashes = ", ".join(v.document.key_hash for v in matches)
        raise FailedPrecondition(f"prefix {ident!r} matches {len(matches)} keys; use the hash: {hashes}")
    return matches[0]


async def revoke_key(store: ConfigStore, ident: str, *, actor: str) -> tuple[ApiKey, int]:
    cur = await find_key(store, ident)
    if cur.document.revoked:
        raise FailedPrecondition(f"key {cur.document.display_prefix}... is already revoked")
    revoked = dataclasses.replace(cur.document, revoked=True)
    rev = await store.put(revoked, actor=actor, expected_revision=cur.mod_revision, action="revoke")
    return revoked, rev


# -- tiers, degradation, power -----------------------------------------------------------------


async def set_tier(store: ConfigStore, name: str, values: Mapping[str, Any], *, actor: str) -> tuple[bool, int]:
    """Updates the given limits of a tier, or creates it (then every limit is required)."""
    cur = await store.get(f"tiers/{name}")
    if cur is None:
        missing = [f for f in schema.TIER_LIMIT_FIELDS if f not in values]
        if missing:
            raise InvalidArgument(f"tiers/{name} does not exist; to create it give every limit "
                                  f"(missing: {', '.join(missing)})")
        return True, await store.create(Tier(name=name, **values), actor=actor)
    new = dataclasses.replace(cur.document, **values)
    return False, await store.put(new, actor=actor, expected_revision=cur.mod_revision)


async def set_degradation(store: ConfigStore, *, thresholds: Mapping[str, float] | None = None,
                          ladder: Mapping[str, tuple[str, ...]] | None = None,
                          cap_max_tokens: int | None = None,
                          settings: Mapping[str, Any] | None = None, actor: str) -> int:
    """Changes the given parts of the degradation policy (creates it when every threshold and
    a ladder are given). `settings`: hysteresis_margin, hold_seconds, enabled."""
    settings = dict(settings or {})
    if cap_max_tokens is not None:
        settings["cap_max_tokens"] = cap_max_tokens
    cur = await store.get("degradation")
    if cur is None:
        fields = [f.name for f in dataclasses.fields(DegradationThresholds)]
        if thresholds is None or set(fields) - set(thresholds) or ladder is None:
            raise InvalidArgument("degradation does not exist yet; give every threshold "
                                  f"({', '.join(fields)}) and a ladder")
        doc = Degradation(DegradationThresholds(**thresholds), ladder, **settings)
        return await store.create(doc, actor=actor)
    d = cur.document
    doc = dataclasses.replace(d, thresholds=dataclasses.replace(d.thresholds, **(thresholds or {})),
                              ladder={**d.ladder, **(ladder or {})}, **settings)
    return await store.put(doc, actor=actor, expected_revision=cur.mod_revision)


async def set_power_budget(store: ConfigStore, watts: float, *, actor: str) -> int:
    return await store.put(PowerBudget(watts), actor=actor)


# -- models and routes -------------------------------------------------------------------------


async def set_model_version(store: ConfigStore, name: str, version: str, artifact: str,
                            max_context: int, *, make_default: bool = False, actor: str) -> int:
    cur = await store.get(f"models/{name}")
    mv = ModelVersion(artifact, max_context)
    if cur is None:
        return await store.create(ModelSpec(name, {version: mv}, version), actor=actor)
    spec = cur.document
    doc = ModelSpec(name, {**spec.versions, version: mv}, version if make_default else spec.default_version)
    return await store.put(doc, actor=actor, expected_revision=cur.mod_revision)


async def set_route(store: ConfigStore, model: str, weights: Mapping[str, int], *,
                    sticky: bool | None = None, actor: str) -> int:
    cur = await store.get(f"routes/{model}")
    keep_sticky = cur.document.sticky if cur else False
    doc = Route(model, dict(weights), keep_sticky if sticky is None else sticky)
    return await store.put(doc, actor=actor, expected_revision=cur.mod_revision if cur else 0,
                           action="route")


def canary_weights(current: Mapping[str, int], version: str, percent: int) -> dict[str, int]:
    """`version` gets `percent`; the rest keep their mutual proportions; the sum is 100."""
    if isinstance(percent, bool) or not isinstance(percent, int) or not 0 <= percent <= 100:
        raise InvalidArgument(f"canary percent must be an integer 0-100, got {percent!r}")
    others = {v: w for v, w in current.items() if v != version}
    total = sum(others.values())
    if percent < 100 and total <= 0:
        raise FailedPrecondition(f"no other version carries traffic to keep {100 - percent}% on; "
                                 f"set weights with `tsctl route set` first")
    rest = 100 - percent
    out = {v: (w * rest) // total for v, w in others.items()} if total else {v: 0 for v in others}
    # hand the rounding remainder to the largest current weights so the sum stays exactly 100
    leftover = rest - sum(out.values())
    for v in sorted(others, key=lambda v: (-others[v], v))[:leftover]:
        out[v] += 1
    out[version] = percent
    return out


async def route_canary(store: ConfigStore, model: str, version: str, percent: int, *, actor: str) -> tuple[dict, int]:
    cur = await store.require(f"routes/{model}")
    weights = canary_weights(cur.document.versions, version, percent)
    doc = dataclasses.replace(cur.document, versions=weights)
    rev = await store.put(doc, actor=actor, expected_revision=cur.mod_revision, action="canary",
                          detail=f"{version} -> {percent}%")
    return weights, rev


async def route_rollback(store: ConfigStore, model: str, *, actor: str) -> tuple[int, int]:
    """Restores the route as it was before its last change; returns (restored revision, new)."""
    key = f"routes/{model}"
    history = await store.history(key)
    if not history:
        raise FailedPrecondition(f"{key} has no recorded changes to roll back")
    target = history[-1].revision - 1
    return target, await store.rollback(key, target, actor=actor)


# -- status ------------------------------------------------------------------------------------


async def cluster_status(store: ConfigStore) -> dict:
    """Registered engines and gateways, the config revision and the last change."""
    revision = await store.revision()
    async def present(kind: str) -> list[dict]:
        # lease_ttl: seconds until the registration expires unless its process renews it
        return [{**schema.to_dict(v.document),
                 "lease_ttl": await store.client.lease_ttl(v.lease) if v.lease else None}
                for v in await store.list(kind)]
    engines, gateways = await present("engines"), await present("gateways")
    log = await store.audit_log()
    last = log[-1] if log else None
    return {
        "endpoints": list(store.options.endpoints),
        "revision": revision,
        "last_change": None if last is None else {
            "revision": last.revision, "key": last.key, "action": last.action, "actor": last.actor,
            "at": last.at, "age_seconds": _age(last.at)},
        "engines": engines,
        "gateways": gateways,
    }


def _age(iso: str) -> float | None:
    try:
        then = dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
    return round(max(0.0, time.time() - then), 1)
