"""Admin operations over a `ConfigStore`: what `tsctl` does, importable (the launcher issues
its demo key with `issue_key`). Each write is audited under `actor` and refuses to overwrite a
concurrent change (`Conflict`).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import time
from dataclasses import dataclass
from typing import Any, Mapping

from controlplane import schema
from controlplane.schema import (ApiKey, CanaryGuard, Degradation, DegradationThresholds, ModelSpec,
                                 ModelVersion, PowerBudget, Route, Tenant, Tier)
from controlplane.store import ConfigStore, Versioned
from tokenserve.runtime.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound

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
    """Sets the weights by hand, which ends any guarded canary (the guard is dropped)."""
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


@dataclass(frozen=True)
class GuardLimits:
    """What `tsctl route canary --max-error-rate/--max-ttft-p99/--window/--min-requests` asks."""

    max_error_rate: float | None = None
    max_ttft_p99_seconds: float | None = None
    window_seconds: float | None = None
    min_requests: int | None = None

    @property
    def given(self) -> bool:
        return any(v is not None for v in dataclasses.astuple(self))


def _guard(current: Route, version: str, limits: GuardLimits) -> CanaryGuard | None:
    """The guard a canary of `version` carries: new limits when given, else the current
    guard when it guards the same version. Stable: the current guard's, else the version
    that carried the most traffic before this canary."""
    same = current.canary if current.canary and current.canary.version == version else None
    if not limits.given:
        return same
    if same is not None:
        stable = same.stable
    else:
        others = {v: w for v, w in current.versions.items() if v != version}
        if not others:
            raise FailedPrecondition(f"routes/{current.model} has no other version to fall back"
                                     " to; a guarded canary needs a stable version")
        stable = min(others, key=lambda v: (-others[v], v))
    defaults = CanaryGuard(version, stable, max_error_rate=limits.max_error_rate,
                           max_ttft_p99_seconds=limits.max_ttft_p99_seconds)
    return dataclasses.replace(defaults, **{k: v for k, v in (
        ("window_seconds", limits.window_seconds), ("min_requests", limits.min_requests))
        if v is not None})


async def route_canary(store: ConfigStore, model: str, version: str, percent: int, *,
                       actor: str, limits: GuardLimits = GuardLimits()) -> tuple[Route, int]:
    """Gives `version` `percent`% of the traffic, guarded by `limits` when given (a canary at
    0% carries no guard)."""
    cur = await store.require(f"routes/{model}")
    weights = canary_weights(cur.document.versions, version, percent)
    guard = _guard(cur.document, version, limits) if percent > 0 else None
    doc = dataclasses.replace(cur.document, versions=weights, canary=guard)
    detail = f"{version} -> {percent}%" + (f"; guard {guard.describe()}" if guard else "")
    rev = await store.put(doc, actor=actor, expected_revision=cur.mod_revision, action="canary",
                          detail=detail)
    return doc, rev


async def route_promote(store: ConfigStore, model: str, version: str, *,
                        actor: str) -> tuple[Route, int]:
    """Completes a rollout: `version` gets 100%, the others 0, the guard is cleared."""
    cur = await store.require(f"routes/{model}")
    weights = {v: 0 for v in cur.document.versions} | {version: 100}
    doc = dataclasses.replace(cur.document, versions=weights, canary=None)
    rev = await store.put(doc, actor=actor, expected_revision=cur.mod_revision, action="promote",
                          detail=f"{version} -> 100%")
    return doc, rev


async def roll_back_canary(store: ConfigStore, model: str, version: str, reason: str, *,
                           actor: str) -> int | None:
    """A gateway's rollback of a breached canary: the guard's stable version gets 100% and
    the guard is cleared, audited with `reason`. One transaction on the route's mod revision,
    so when several gateways see the breach at once one rolls back and the others find it
    done, or lose the compare, and do nothing (None)."""
    cur = await store.get(f"routes/{model}")
    route = cur.document if cur else None
    if route is None or route.canary is None or route.canary.version != version \
            or route.versions.get(version, 0) == 0:
        return None  # already rolled back, promoted or changed by hand
    weights = {v: 0 for v in route.versions} | {route.canary.stable: 100}
    doc = dataclasses.replace(route, versions=weights, canary=None)
    try:
        return await store.put(doc, actor=actor, expected_revision=cur.mod_revision,
                               action="canary-rollback", detail=reason)
    except Conflict:
        return None


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
