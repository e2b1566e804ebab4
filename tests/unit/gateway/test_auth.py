"""Key -> caller against a real config snapshot."""
from __future__ import annotations

import dataclasses

import pytest

from controlplane.schema import Tenant
from services.gateway.auth import MISSING_METADATA, authenticate
from tests.unit.gateway.snapshots import build, issue
from tokenserve.runtime.errors import PermissionDenied, Unauthenticated


def md(key: str):
    return (("authorization", f"Bearer {key}"),)


def test_a_valid_key_gives_the_tenant_and_its_tier_limits():
    key, record = issue()
    caller = authenticate(build(keys=[record]), md(key))
    assert (caller.tenant_id, caller.tier, caller.priority, caller.max_tokens) == (
        "acme", "free", 0, 16)
    assert caller.key_prefix == key[:10]


def test_tenant_overrides_apply():
    key, record = issue()
    snap = build(keys=[record], tenants=[Tenant("acme", "Acme", "free", overrides={"max_tokens": 8})])
    assert authenticate(snap, md(key)).max_tokens == 8


def test_missing_metadata_says_how_to_send_the_key():
    with pytest.raises(Unauthenticated) as err:
        authenticate(build(), (("x-other", "1"),))
    assert err.value.message == MISSING_METADATA
    assert "authorization: Bearer ts-" in err.value.message


@pytest.mark.parametrize("value", ["ts-abc", "Basic dXNlcg==", "Bearer ", "Bearer ts-unknown"])
def test_malformed_or_unknown_keys_are_unauthenticated(value):
    _, record = issue()
    with pytest.raises(Unauthenticated):
        authenticate(build(keys=[record]), (("authorization", value),))


def test_revoked_key_is_unauthenticated():
    key, record = issue()
    snap = build(keys=[dataclasses.replace(record, revoked=True)])
    with pytest.raises(Unauthenticated):
        authenticate(snap, md(key))


def test_disabled_tenant_is_permission_denied():
    key, record = issue()
    snap = build(keys=[record], tenants=[Tenant("acme", "Acme", "free", enabled=False)])
    with pytest.raises(PermissionDenied, match="disabled"):
        authenticate(snap, md(key))


def test_each_call_sees_the_snapshot_it_is_given():
    key, record = issue()
    assert authenticate(build(keys=[record]), md(key)).tenant_id == "acme"
    with pytest.raises(Unauthenticated):
        authenticate(build(keys=[]), md(key))
