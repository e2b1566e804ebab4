"""Who is calling: `authorization: Bearer ts-...` metadata -> tenant and effective tier.

Every call looks the key up in the current config snapshot (the watcher swaps snapshots
within a second of a change), so a new key works and a revoked key fails without any cache
here that could outlive the change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from controlplane.schema import hash_api_key
from controlplane.snapshot import ConfigSnapshot
from services.gateway.admission import Limits
from tokenserve.runtime.errors import PermissionDenied, Unauthenticated

MISSING_METADATA = ("missing authorization metadata: send 'authorization: Bearer ts-...'")


@dataclass(frozen=True)
class Caller:
    tenant_id: str
    tier: str
    # Engine scheduling priority (higher runs first) and the tier's max_tokens cap.
    priority: int
    max_tokens: int
    # First characters of the key, safe to log.
    key_prefix: str
    # What admission enforces for this tenant (tier + overrides).
    limits: Limits


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The key from `authorization: Bearer <key>`; Unauthenticated when absent or malformed."""
    values = [v for k, v in (metadata or ()) if k.lower() == "authorization"]
    if not values:
        raise Unauthenticated(MISSING_METADATA)
    value = values[0].decode() if isinstance(values[0], bytes) else values[0]
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("authorization metadata must be 'Bearer ts-...'")
    return token.strip()


def authenticate(snapshot: ConfigSnapshot, metadata) -> Caller:
    key = bearer_token(metadata)
    found = snapshot.authenticate(key)
    if found is None:
        _refuse(snapshot, key)
    record, tenant, tier = found
    return Caller(tenant_id=tenant.id, tier=tier.name, priority=tier.priority,
                  max_tokens=tier.max_tokens, key_prefix=record.display_prefix,
                  limits=Limits.of(tier))


def _refuse(snapshot: ConfigSnapshot, key: str):
    """Says why a key was refused: a valid key of a disabled tenant is PERMISSION_DENIED,
    anything else UNAUTHENTICATED (never telling whether an unknown key exists)."""
    record = snapshot.keys.get(hash_api_key(key)) if key.startswith("ts-") else None
    if record is not None and not record.revoked:
        tenant = snapshot.tenants.get(record.tenant_id)
        if tenant is not None and not tenant.enabled:
            raise PermissionDenied(f"tenant {tenant.id!r} is disabled")
        if tenant is not None:
            raise PermissionDenied(
                f"tenant {tenant.id!r} is on tier {tenant.tier!r}, which is not configured")
    raise Unauthenticated("invalid or revoked API key")
