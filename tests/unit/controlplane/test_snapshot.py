"""ConfigSnapshot: authentication rules, changes, and the file round trip."""
from __future__ import annotations

import pytest

from controlplane.schema import EngineRegistration, Tenant, generate_api_key
from controlplane.seed import default_documents
from controlplane.snapshot import ConfigSnapshot
from tokenserve.runtime.errors import InvalidArgument


def make(*extra):
    docs = {d.key: d for d in [*default_documents(), *extra]}
    return ConfigSnapshot.from_documents(7, docs)


def test_authenticate_paths():
    key, record = generate_api_key("acme")
    snap = make(Tenant("acme", "Acme", "standard", overrides={"max_tokens": 100}), record)
    found = snap.authenticate(key)
    assert found is not None
    rec, tenant, tier = found
    assert rec == record and tenant.id == "acme" and tier.name == "standard" and tier.max_tokens == 100
    assert snap.authenticate(key + "x") is None
    assert snap.authenticate("not-a-key") is None
    assert snap.authenticate(None) is None


def test_revoked_key_disabled_tenant_and_missing_tier_refused():
    key, record = generate_api_key("acme")
    tenant = Tenant("acme", "Acme", "free")
    snap = make(tenant, record)
    assert snap.authenticate(key) is not None
    revoked = snap.with_changes(8, {record.key: record.__class__(**{**record.__dict__, "revoked": True})})
    assert revoked.authenticate(key) is None
    disabled = snap.with_changes(8, {tenant.key: Tenant("acme", "Acme", "free", enabled=False)})
    assert disabled.authenticate(key) is None
    no_tier = snap.with_changes(8, {"tiers/free": None})
    assert no_tier.authenticate(key) is None and no_tier.revision == 8


def test_file_round_trip(tmp_path):
    key, record = generate_api_key("acme")
    snap = make(Tenant("acme", "Acme", "free"), record,
                EngineRegistration("e0", "127.0.0.1:5000", "smollm2-135m-instruct", "q4_1", 8))
    path = tmp_path / "snap.json"
    snap.save(path)
    loaded = ConfigSnapshot.load(path)
    assert loaded.source == "file" and loaded.revision == 7
    assert dict(loaded.documents) == dict(snap.documents)
    assert loaded.authenticate(key) is not None
    assert [e.id for e in loaded.engines_for("smollm2-135m-instruct", "q4_1")] == ["e0"]
    path.write_text('{"revision": 3}')
    with pytest.raises(InvalidArgument, match="snapshot file is damaged"):
        ConfigSnapshot.load(path)
