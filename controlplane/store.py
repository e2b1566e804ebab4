"""Validated, audited reads and writes of the policy documents in etcd.

Every write is one etcd transaction that (1) compares the key's mod revision with the one the
writer last saw (a concurrent writer loses with `Conflict`), (2) writes or deletes the document
and (3) writes an audit entry `audit/<revision>` (actor, action, key, before, after) in the same
transaction. Keys are relative to `schema.PREFIX`, e.g. `tiers/free`.

    async with ConfigStore(["127.0.0.1:2379"]) as store:
        cur = await store.get("tiers/free")
        await store.put(dataclasses.replace(cur.document, requests_per_second=20),
                        actor="ops", expected_revision=cur.mod_revision)
"""
from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from controlplane import schema
from controlplane.etcd_client import (EtcdClient, EtcdOptions, compare_absent, compare_mod,
                                      op_delete, op_get, op_put, prefix_end)
from controlplane.schema import Document
from tokenserve.runtime.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound, Unavailable

AUDIT = "audit/"
_MAX_ATTEMPTS = 20  # audit-slot races with writers of *other* keys; each retry re-reads


@dataclass(frozen=True)
class Versioned:
    """A document with the etcd revisions it was read at."""

    key: str
    document: Document
    mod_revision: int
    create_revision: int
    lease: int = 0  # etcd lease id for registrations (0 = none)


@dataclass(frozen=True)
class AuditEntry:
    revision: int  # the etcd revision of the write
    actor: str
    action: str  # put | create | delete | rollback | seed | ...
    key: str
    before: dict | None
    after: dict | None
    at: str  # ISO 8601 UTC
    detail: str = ""

    @classmethod
    def from_json(cls, raw: bytes) -> "AuditEntry":
        d = json.loads(raw)
        return cls(**{k: d.get(k) for k in ("revision", "actor", "action", "key", "before", "after", "at")},
                   detail=d.get("detail", ""))


def audit_key(revision: int) -> str:
    return f"{AUDIT}{revision:020d}"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ConfigStore:
    """Async access to the config documents. Use as `async with` or call `close()`."""

    def __init__(self, endpoints: Sequence[str] | str | EtcdOptions, *, user: str | None = None,
                 password: str | None = None, ca_file: str | None = None,
                 cert_file: str | None = None, key_file: str | None = None, timeout: float = 5.0):
        if isinstance(endpoints, EtcdOptions):
            self.options = endpoints
        else:
            self.options = EtcdOptions.of(endpoints, user=user, password=password, ca_file=ca_file,
                                          cert_file=cert_file, key_file=key_file, timeout=timeout)
        self.client = EtcdClient(self.options)

    async def __aenter__(self) -> "ConfigStore":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.client.close()

    # -- reads --------------------------------------------------------------------------------

    async def revision(self) -> int:
        """The current etcd revision (also proves etcd is reachable)."""
        resp = await self.client.range(schema.PREFIX.encode(), keys_only=True)
        return resp.header.revision

    async def get(self, key: str) -> Versioned | None:
        schema.split_key(key)
        resp = await self.client.range((schema.PREFIX + key).encode())
        return self._versioned(resp.kvs[0]) if resp.kvs else None

    async def require(self, key: str) -> Versioned:
        cur = await self.get(key)
        if cur is None:
            raise NotFound(f"{key} does not exist")
        return cur

    async def list(self, kind: str) -> list[Versioned]:
        """Every document of a collection (`tiers`, `tenants`, `keys`, `routes`, ...)."""
        if kind in schema.SINGLETONS:
            cur = await self.get(kind)
            return [cur] if cur else []
        if kind not in schema.COLLECTIONS:
            raise InvalidArgument(f"unknown collection {kind!r}; one of {', '.join(schema.COLLECTIONS)}")
        prefix = f"{schema.PREFIX}{kind}/".encode()
        resp = await self.client.range(prefix, prefix_end(prefix))
        return [self._versioned(kv) for kv in resp.kvs]

    def _versioned(self, kv: Any) -> Versioned:
        key = kv.key.decode()[len(schema.PREFIX):]
        return Versioned(key, schema.parse(key, kv.value), kv.mod_revision, kv.create_revision, kv.lease)

    # -- writes -------------------------------------------------------------------------------

    async def put(self, doc: Document, *, actor: str, expected_revision: int | None = None,
                  action: str = "put", detail: str = "") -> int:
        """Writes `doc` at its key; returns the revision of the write.

        expected_revision: the mod revision the caller read (0 = the key must not exist);
        None = the revision this call reads first, which still refuses a concurrent writer.
        """
        return await self._write(doc.key, doc, actor=actor, expected=expected_revision,
                                 action=action, detail=detail)

    async def create(self, doc: Document, *, actor: str, action: str = "create") -> int:
        return await self.put(doc, actor=actor, expected_revision=0, action=action)

    async def delete(self, key: str, *, actor: str, expected_revision: int | None = None,
                     action: str = "delete", detail: str = "") -> int:
        schema.split_key(key)
        return await self._write(key, None, actor=actor, expected=expected_revision,
                                 action=action, detail=detail)

    async def update(self, key: str, change: Callable[[Document], Document], *, actor: str,
                     action: str = "put") -> int:
        """Read-modify-write: `change(current) -> new`; Conflict if the key moved meanwhile."""
        cur = await self.require(key)
        new = change(cur.document)
        if new.key != key:
            raise InvalidArgument(f"{key}: an update may not change the document's key (to {new.key})")
        return await self.put(new, actor=actor, expected_revision=cur.mod_revision, action=action)

    async def _write(self, key: str, doc: Document | None, *, actor: str, expected: int | None,
                     action: str, detail: str) -> int:
        if not actor or not isinstance(actor, str):
            raise InvalidArgument("actor must name who makes the change (for the audit log)")
        full = (schema.PREFIX + key).encode()
        value = schema.encode(doc) if doc is not None else None
        refs = await self._references(doc) if doc is not None else []
        if doc is None:
            await self._check_unused(key)
        for _ in range(_MAX_ATTEMPTS):
            cur = await self.client.range(full)
            kv = cur.kvs[0] if cur.kvs else None
            seen = kv.mod_revision if kv else 0
            if expected is None:
                expected = seen
            if seen != expected:
                raise self._conflict(key, seen, expected)
            if doc is None and kv is None:
                raise NotFound(f"{key} does not exist")
            guess = cur.header.revision + 1  # our write's revision unless another lands first
            entry = {"revision": guess, "actor": actor, "action": action, "key": key,
                     "before": json.loads(kv.value) if kv else None,
                     "after": schema.to_dict(doc) if doc is not None else None,
                     "at": _now(), "detail": detail}
            slot = (schema.PREFIX + audit_key(guess)).encode()
            compare = [compare_mod(full, expected), compare_absent(slot)]
            compare += [compare_mod((schema.PREFIX + k).encode(), r) for k, r in refs]
            change = op_put(full, value) if doc is not None else op_delete(full)
            resp = await self.client.txn(compare, [change, op_put(slot, json.dumps(entry).encode())],
                                         [op_get(full)])
            if not resp.succeeded:
                kvs = resp.responses[0].response_range.kvs
                now_rev = kvs[0].mod_revision if kvs else 0
                if now_rev != expected:
                    raise self._conflict(key, now_rev, expected)
                refs = await self._references(doc) if doc is not None else []
                continue  # the audit slot went to another key's writer: re-read and retry
            revision = resp.header.revision
            if revision != guess:
                await self._move_audit(guess, revision, entry)
            return revision
        raise Unavailable(f"{key}: gave up after {_MAX_ATTEMPTS} attempts; etcd is too busy, retry")

    async def _move_audit(self, guess: int, revision: int, entry: dict) -> None:
        # An unrelated write (e.g. a lease expiry) took revision `guess` first; file the entry
        # under the revision the write really got.
        entry = {**entry, "revision": revision}
        new = (schema.PREFIX + audit_key(revision)).encode()
        old = (schema.PREFIX + audit_key(guess)).encode()
        await self.client.txn([compare_absent(new)],
                              [op_put(new, json.dumps(entry).encode()), op_delete(old)])

    def _conflict(self, key: str, now_rev: int, expected: int) -> Conflict:
        if expected == 0:
            return Conflict(f"{key} already exists (revision {now_rev}); use an update instead")
        if now_rev == 0:
            return Conflict(f"{key} was deleted by another writer after you read it at "
                            f"revision {expected}; re-read and retry")
        return Conflict(f"{key} was changed by another writer (now at revision {now_rev}, you read "
                        f"revision {expected}); re-read and retry")

    async def _references(self, doc: Document) -> list[tuple[str, int]]:
        """Documents `doc` points at, with their revisions, so the write can guard on them."""
        if isinstance(doc, schema.Tenant):
            ref = await self._need(f"tiers/{doc.tier}", f"{doc.key}: tier {doc.tier!r} does not exist")
            return [(ref.key, ref.mod_revision)]
        if isinstance(doc, schema.ApiKey):
            ref = await self._need(f"tenants/{doc.tenant_id}", f"{doc.key}: tenant {doc.tenant_id!r} does not exist")
            return [(ref.key, ref.mod_revision)]
        if isinstance(doc, schema.Route):
            ref = await self._need(f"models/{doc.model}", f"{doc.key}: model {doc.model!r} does not exist")
            missing = sorted(set(doc.versions) - set(ref.document.versions))
            if missing:
                raise InvalidArgument(f"{doc.key}: version(s) {', '.join(missing)} are not in "
                                      f"models/{doc.model} ({', '.join(sorted(ref.document.versions))})")
            return [(ref.key, ref.mod_revision)]
        return []

    async def _need(self, key: str, message: str) -> Versioned:
        cur = await self.get(key)
        if cur is None:
            raise FailedPrecondition(message)
        return cur

    async def _check_unused(self, key: str) -> None:
        kind, ident = schema.split_key(key)
        if kind == "tiers":
            users = [v.key for v in await self.list("tenants") if v.document.tier == ident]
        elif kind == "tenants":
            users = [v.key for v in await self.list("keys")
                     if v.document.tenant_id == ident and not v.document.revoked]
        elif kind == "models":
            users = [v.key for v in await self.list("routes") if v.document.model == ident]
        else:
            return
        if users:
            raise FailedPrecondition(f"{key} is still used by {', '.join(users[:5])}"
                                     f"{' ...' if len(users) > 5 else ''}; change those first")

    # -- audit, history, rollback -------------------------------------------------------------

    async def audit_log(self, key: str | None = None) -> list[AuditEntry]:
        """Audit entries, oldest first; only those for `key` when given."""
        prefix = (schema.PREFIX + AUDIT).encode()
        resp = await self.client.range(prefix, prefix_end(prefix))
        entries = [AuditEntry.from_json(kv.value) for kv in resp.kvs]
        entries = [e for e in entries if key is None or e.key == key]
        return sorted(entries, key=lambda e: e.revision)

    async def history(self, key: str) -> list[AuditEntry]:
        schema.split_key(key)
        return await self.audit_log(key)

    async def document_at(self, key: str, revision: int) -> dict | None:
        """The document `key` held at `revision` (None = absent then), from the audit log,
        else from etcd's own history if not compacted yet."""
        current = await self.revision()
        if revision > current:
            raise InvalidArgument(f"revision {revision} is in the future (current {current})")
        entries = [e for e in await self.history(key) if e.revision <= revision]
        if entries:
            return entries[-1].after
        try:
            old = await self.client.range((schema.PREFIX + key).encode(), revision=revision)
        except FailedPrecondition as e:  # compacted
            raise FailedPrecondition(f"{key}: revision {revision} is not in the audit log and etcd "
                                     f"has compacted it ({e})") from None
        return json.loads(old.kvs[0].value) if old.kvs else None

    async def rollback(self, key: str, to_revision: int, *, actor: str) -> int:
        """Writes back the document `key` had at `to_revision` (audited as "rollback")."""
        if to_revision <= 0:
            raise InvalidArgument(f"to_revision must be > 0, got {to_revision}")
        old = await self.document_at(key, to_revision)
        cur = await self.get(key)
        detail = f"to revision {to_revision}"
        if old is None:
            if cur is None:
                raise FailedPrecondition(f"{key} did not exist at revision {to_revision} and does not exist now")
            return await self.delete(key, actor=actor, expected_revision=cur.mod_revision,
                                     action="rollback", detail=detail)
        doc = schema.parse(key, old)
        return await self.put(doc, actor=actor, expected_revision=cur.mod_revision if cur else 0,
                              action="rollback", detail=detail)
