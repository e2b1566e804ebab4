"""An immutable view of the whole config at one etcd revision, and its file form.

Services read policy only from a `ConfigSnapshot` handed out by the watcher: one object, one
revision, never half of a change. The same snapshot is kept on local disk (last known good) so a
service can start while etcd is down.
"""
from __future__ import annotations

import dataclasses
import hmac
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from controlplane import schema
from controlplane.schema import (ApiKey, Degradation, Document, EngineRegistration,
                                 GatewayRegistration, ModelSpec, PowerBudget, Route, Tenant, Tier)
from tokenserve.runtime.errors import InvalidArgument



def _empty() -> Mapping:
    return MappingProxyType({})


@dataclass(frozen=True)
class ConfigSnapshot:
    """Every config document at `revision`. Build with `from_documents`."""

    revision: int
    tiers: Mapping[str, Tier] = field(default_factory=_empty)
    tenants: Mapping[str, Tenant] = field(default_factory=_empty)
    keys: Mapping[str, ApiKey] = field(default_factory=_empty)  # by sha256 hex of the full key
    routes: Mapping[str, Route] = field(default_factory=_empty)  # by model
    models: Mapping[str, ModelSpec] = field(default_factory=_empty)
    engines: Mapping[str, EngineRegistration] = field(default_factory=_empty)
    gateways: Mapping[str, GatewayRegistration] = field(default_factory=_empty)
    degradation: Degradation | None = None
    power_budget: PowerBudget | None = None
    synced_at: float = 0.0  # unix time this config was last confirmed current with etcd
    source: str = "etcd"  # "etcd" or "file" (loaded from the last-known-good snapshot)
    documents: Mapping[str, Document] = field(default_factory=_empty, repr=False)  # by relative key

    @classmethod
    def from_documents(cls, revision: int, documents: Mapping[str, Document], *,
                       synced_at: float | None = None, source: str = "etcd") -> "ConfigSnapshot":
        groups: dict[str, dict] = {k: {} for k in schema.COLLECTIONS}
        singles: dict[str, Document] = {}
        for key, doc in documents.items():
            kind, ident = schema.split_key(key)
            if ident is None:
                singles[kind] = doc
            else:
                groups[kind][ident] = doc
        frozen = {k: MappingProxyType(v) for k, v in groups.items()}
        return cls(revision=revision, **frozen, degradation=singles.get("degradation"),
                   power_budget=singles.get("power_budget"),
                   synced_at=time.time() if synced_at is None else synced_at, source=source,
                   documents=MappingProxyType(dict(documents)))

    # -- lookups the services need ------------------------------------------------------------

    def authenticate(self, key: str) -> tuple[ApiKey, Tenant, Tier] | None:
        """(key record, tenant, effective tier) for a presented API key, or None.

        None for unknown, revoked or malformed keys, disabled tenants and tenants whose tier
        is missing: a caller must never be let through without a known tier.
        """
        if not isinstance(key, str) or not key.startswith(schema.KEY_PREFIX) or len(key) > 256:
            return None
        digest = schema.hash_api_key(key)
        record = self.keys.get(digest)
        # the dict lookup already matched; compare again in constant time for defence in depth
        if record is None or not hmac.compare_digest(record.key_hash, digest) or record.revoked:
            return None
        tenant = self.tenants.get(record.tenant_id)
        if tenant is None or not tenant.enabled:
            return None
        tier = self.tiers.get(tenant.tier)
        if tier is None:
            return None
        return record, tenant, tenant.effective(tier)

    def engines_for(self, model: str, version: str | None = None) -> list[EngineRegistration]:
        return sorted((e for e in self.engines.values()
                       if e.model == model and (version is None or e.version == version)),
                      key=lambda e: e.id)

    def seconds_since_sync(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.synced_at)

    # -- changes ------------------------------------------------------------------------------

    def with_changes(self, revision: int, changes: Mapping[str, Document | None], *,
                     synced_at: float | None = None) -> "ConfigSnapshot":
        """A new snapshot with `changes` applied (None deletes the key)."""
        docs = dict(self.documents)
        for key, doc in changes.items():
            if doc is None:
                docs.pop(key, None)
            else:
                docs[key] = doc
        return ConfigSnapshot.from_documents(revision, docs, synced_at=synced_at)

    def confirmed(self, at: float | None = None) -> "ConfigSnapshot":
        """The same config, confirmed current at `at` (cheap: shares every mapping)."""
        return dataclasses.replace(self, synced_at=time.time() if at is None else at, source="etcd")

    # -- file form ----------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps({"revision": self.revision, "synced_at": self.synced_at,
                           "documents": {k: schema.to_dict(d) for k, d in sorted(self.documents.items())}},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str = "file") -> "ConfigSnapshot":
        try:
            data = json.loads(text)
            docs = {k: schema.parse(k, v) for k, v in data["documents"].items()}
            return cls.from_documents(int(data["revision"]), docs,
                                      synced_at=float(data["synced_at"]), source=source)
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"config snapshot file is damaged: {e}") from None

    def save(self, path: Path) -> None:
        """Writes atomically (temp file + rename) so a crash never leaves half a snapshot."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path) -> "ConfigSnapshot":
        return cls.from_json(Path(path).read_text())
