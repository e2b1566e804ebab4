"""Real control-plane snapshots for gateway tests (built from schema documents, no etcd)."""
from __future__ import annotations

from controlplane.schema import (EngineRegistration, ModelSpec, ModelVersion, Route, Tenant,
                                 Tier, generate_api_key)
from controlplane.snapshot import ConfigSnapshot

MODEL = "tiny"


def build(*, routes=None, engines=(), tenants=None, keys=(), max_context=64,
          engine_max_context=0, revision=1) -> ConfigSnapshot:
    docs = {}
    for tier in (Tier("free", 10, 20_000, 1_000_000, 4, 0, 16),
                 Tier("premium", 200, 400_000, 20_000_000, 64, 2, 32)):
        docs[tier.key] = tier
    for t in tenants or (Tenant("acme", "Acme", "free"),):
        docs[t.key] = t
    for k in keys:
        docs[k.key] = k
    spec = ModelSpec(MODEL, {"v1": ModelVersion("builtin:tiny", max_context),
                             "v2": ModelVersion("builtin:tiny", max_context)}, "v1")
    docs[spec.key] = spec
    for r in routes if routes is not None else (Route(MODEL, {"v1": 1}),):
        docs[r.key] = r
    for i, (version, endpoint) in enumerate(engines):
        e = EngineRegistration(f"engine-{i}", endpoint, MODEL, version, 8,
                               max_context=engine_max_context)
        docs[e.key] = e
    return ConfigSnapshot.from_documents(revision, docs)


def issue(tenant: str = "acme"):
    """(key, record) for `tenant`."""
    return generate_api_key(tenant)
