"""Live config for services: read everything, then watch from that revision.

    watcher = ConfigWatcher(["127.0.0.1:2379"], snapshot_path=Path("var/gateway.snapshot.json"),
                            service="gateway")
    await watcher.start()          # raises Unavailable if neither etcd nor a snapshot file
    watcher.on_change(lambda snap: log.info("config", revision=snap.revision))
    found = watcher.snapshot.authenticate(api_key)   # always one consistent revision
    ...
    await watcher.close()

Behaviour: the stream is watched with a progress request every `heartbeat` seconds, so a dead
etcd is noticed within ~3 heartbeats and `seconds_since_sync` stays honest while nothing
changes. On a lost stream it reconnects with backoff and resumes from the last applied
revision; if etcd has compacted that revision it re-reads everything and watches again. Every
applied change is written to `snapshot_path` (last known good); with etcd down at start the
file is loaded instead. There is no fall-back to "no limits": no etcd and no file -> no start.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import random
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import grpc
import structlog
from aetcd import rpc
from prometheus_client import REGISTRY, CollectorRegistry, Gauge

from controlplane import schema
from controlplane.etcd_client import EtcdClient, EtcdOptions, describe, prefix_end, stop_task
from controlplane.snapshot import ConfigSnapshot
from controlplane.store import AUDIT
from tokenserve.runtime.errors import ServiceError, Unavailable

Callback = Callable[[ConfigSnapshot], Awaitable[None] | None]
# lazy proxy: picks up configure_logging() even when called after this import
log = structlog.get_logger(component="config_watcher")
# The longest wait between reconnects while etcd is away: once it is back, a change made
# there applies within a second (at most this long to see it return, then the re-read); a
# connection attempt every half second costs etcd nothing.
MAX_RECONNECT_SECONDS = 0.5

_gauges: dict[tuple[int, str], Gauge] = {}  # one Gauge per (registry, name): watchers may restart


def _gauge(registry: CollectorRegistry, name: str, doc: str) -> Gauge:
    key = (id(registry), name)
    if key not in _gauges:
        _gauges[key] = Gauge(name, doc, registry=registry)
    return _gauges[key]


class ConfigWatcher:
    def __init__(self, endpoints: Sequence[str] | str | EtcdOptions, *,
                 snapshot_path: Path | None = None, prefix: str = schema.PREFIX,
                 service: str | None = None, registry: CollectorRegistry | None = None,
                 user: str | None = None, password: str | None = None, ca_file: str | None = None,
                 cert_file: str | None = None, key_file: str | None = None,
                 timeout: float = 5.0, heartbeat: float = 2.0):
        self.options = EtcdOptions.of(endpoints, user=user, password=password, ca_file=ca_file,
                                      cert_file=cert_file, key_file=key_file, timeout=timeout)
        self.snapshot_path = Path(snapshot_path) if snapshot_path else None
        self.prefix = prefix
        self.heartbeat = heartbeat
        self._client = EtcdClient(self.options)
        self._snapshot: ConfigSnapshot | None = None
        self._published: ConfigSnapshot | None = None
        self._callbacks: list[Callback] = []
        self._changed = asyncio.Condition()
        self._task: asyncio.Task | None = None
        self._closed = False
        self.connected = False
        if service:
            reg = registry or REGISTRY
            _gauge(reg, f"tokenserve_{service}_config_revision",
                   "etcd revision of the config in use").set_function(
                lambda: self._snapshot.revision if self._snapshot else 0)
            _gauge(reg, f"tokenserve_{service}_config_seconds_since_sync",
                   "seconds since the config was last confirmed current with etcd").set_function(
                lambda: self._snapshot.seconds_since_sync() if self._snapshot else float("inf"))

    # -- public -------------------------------------------------------------------------------

    @property
    def snapshot(self) -> ConfigSnapshot:
        if self._snapshot is None:
            raise RuntimeError("ConfigWatcher.start() has not completed")
        return self._snapshot

    def on_change(self, callback: Callback) -> Callback:
        """Calls `callback(snapshot)` (sync or async) after every applied change."""
        self._callbacks.append(callback)
        return callback

    async def start(self) -> ConfigSnapshot:
        resync = False
        try:
            await self._apply(await self._read_all(), initial=True)
        except ServiceError as e:
            if self.snapshot_path is None or not self.snapshot_path.exists():
                await self._client.close()
                where = self.snapshot_path or "(no snapshot_path configured)"
                raise Unavailable(f"cannot load config: {e.message}; and no last-known-good "
                                  f"snapshot at {where}. Refusing to start without policy") from None
            snap = await asyncio.to_thread(ConfigSnapshot.load, self.snapshot_path)
            self._snapshot = snap
            log.warning("config_from_snapshot_file", path=str(self.snapshot_path),
                        revision=snap.revision, age_seconds=round(snap.seconds_since_sync(), 1),
                        reason=e.message)
            resync = True
        self._task = asyncio.get_running_loop().create_task(self._run(resync))
        return self.snapshot

    async def wait_for_revision(self, revision: int, timeout: float | None = None) -> ConfigSnapshot:
        """Waits until the applied config is at `revision` or later."""
        async def wait() -> ConfigSnapshot:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: self._published is not None and self._published.revision >= revision
                    and self._published.source == "etcd")
                return self._published
        return await asyncio.wait_for(wait(), timeout)

    async def close(self) -> None:
        self._closed = True
        await stop_task(self._task)
        self._task = None
        await self._client.close()

    # -- reading and applying -----------------------------------------------------------------

    async def _read_all(self) -> ConfigSnapshot:
        # one range = one revision; it starts after audit/, which sorts first and is not config
        start = prefix_end((self.prefix + AUDIT).encode())
        resp = await self._client.range(start, prefix_end(self.prefix.encode()))
        old = self._snapshot.documents if self._snapshot else {}
        docs = {}
        for kv in resp.kvs:
            key = kv.key.decode()[len(self.prefix):]
            doc = self._parse(key, kv.value, old.get(key))
            if doc is not None:
                docs[key] = doc
        return ConfigSnapshot.from_documents(resp.header.revision, docs)

    def _parse(self, key: str, value: bytes, previous: Any) -> Any:
        try:
            return schema.parse(key, value)
        except ServiceError as e:
            # someone wrote around the schema (etcdctl); keep what we had for that key
            log.warning("config_document_invalid", key=key, error=e.message, kept_previous=previous is not None)
            return previous

    async def _apply(self, snap: ConfigSnapshot, *, initial: bool = False) -> None:
        cur = self._snapshot
        if (not initial and cur is not None and cur.source == "etcd"
                and dict(cur.documents) == dict(snap.documents)):
            self._snapshot = cur.confirmed(snap.synced_at) if snap.revision == cur.revision else snap
            await self._publish()
            return
        self._snapshot = snap  # applied: from here on every reader sees the new config
        if self.snapshot_path is not None:
            try:
                await asyncio.to_thread(snap.save, self.snapshot_path)
            except OSError as e:
                log.warning("config_snapshot_not_saved", path=str(self.snapshot_path), error=str(e))
        if not initial:
            log.info("config_applied", revision=snap.revision)
            for cb in list(self._callbacks):
                try:
                    result = cb(snap)
                    if inspect.isawaitable(result):
                        await result
                except Exception as e:  # a bad subscriber must not stop the config stream
                    log.error("config_callback_failed", error_type=type(e).__name__, error=str(e))
        await self._publish()

    async def _publish(self) -> None:
        # wait_for_revision() wakes only after the file and the callbacks have seen the change
        self._published = self._snapshot
        async with self._changed:
            self._changed.notify_all()

    # -- the background loop ------------------------------------------------------------------

    async def _run(self, resync: bool) -> None:
        backoff = 0.1
        while not self._closed:
            try:
                if resync:
                    await self._apply(await self._read_all())
                    resync = False
                resync = await self._watch(self._snapshot.revision + 1)
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the loop must outlive any failure; it retries
                self.connected = False
                log.warning("config_watch_lost", error_type=type(e).__name__,
                            error=describe(e), retry_in=round(backoff, 2))
                await asyncio.sleep(min(MAX_RECONNECT_SECONDS,
                                        backoff * (1 + random.random() / 2)))
                backoff = min(backoff * 2, MAX_RECONNECT_SECONDS)
                await self._client.reconnect(rotate=True)

    async def _watch(self, start_revision: int) -> bool:
        """Streams changes until the stream breaks (raises) or etcd compacted (returns True)."""
        await self._client.connect()
        call = self._client.watch.Watch(metadata=self._client.metadata)
        beat: asyncio.Task | None = None
        try:
            key = self.prefix.encode()
            await call.write(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                key=key, range_end=prefix_end(key), start_revision=start_revision)))
            while not self._closed:
                resp = await asyncio.wait_for(call.read(), timeout=self.heartbeat * 3)
                if resp is grpc.aio.EOF:
                    raise Unavailable("etcd closed the watch stream")
                if resp.compact_revision:
                    log.warning("config_watch_compacted", compact_revision=resp.compact_revision,
                                wanted=start_revision)
                    return True
                if resp.canceled:
                    raise Unavailable(f"etcd cancelled the watch: {resp.cancel_reason}")
                if resp.created and beat is None:
                    self.connected = True
                    beat = asyncio.get_running_loop().create_task(self._heartbeat(call))
                if resp.events:
                    await self._apply_events(resp)
                elif self._snapshot is not None and not resp.created:
                    # progress: every change up to resp.header.revision has been delivered
                    self._snapshot = self._snapshot.confirmed()
            return False
        finally:
            if beat is not None:
                beat.cancel()
            call.cancel()

    async def _heartbeat(self, call: Any) -> None:
        # a broken stream shows up in the reader (read() fails or times out); stop quietly here
        try:
            while True:
                await asyncio.sleep(self.heartbeat)
                await call.write(rpc.WatchRequest(progress_request=rpc.WatchProgressRequest()))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, ConnectionError):
            return

    async def _apply_events(self, resp: Any) -> None:
        changes: dict[str, Any] = {}
        revision = self._snapshot.revision
        docs = self._snapshot.documents
        for ev in resp.events:
            revision = max(revision, ev.kv.mod_revision)
            key = ev.kv.key.decode()[len(self.prefix):]
            if key.startswith(AUDIT):
                continue
            try:
                schema.split_key(key)
            except ServiceError:
                continue  # not a config key
            if ev.type == rpc.Event.DELETE:
                changes[key] = None
            else:
                doc = self._parse(key, ev.kv.value, docs.get(key))
                if doc is not None:
                    changes[key] = doc
        if changes or self._snapshot.source != "etcd":
            await self._apply(self._snapshot.with_changes(revision, changes))
        else:  # only audit entries moved: same config, newer revision
            self._snapshot = dataclasses.replace(self._snapshot.confirmed(), revision=revision)
            await self._publish()
