"""Usage records on local disk until the meter has them (at-least-once; the meter dedupes).

The gateway and every engine each keep one spool and one sender (this module, shared).
`UsageSpool.put` commits to a SQLite file (WAL) before the service sends the last message of
a request, so a crash of the service after that loses nothing (see DURABILITIES for how
soon it is on disk). `SpoolSender`
ships the oldest events in batches and deletes them only after the meter acknowledged them;
while the meter is down it retries with exponential backoff. A record the meter refuses for
good (INVALID_ARGUMENT naming `events[i]`: say its tenant was deleted) moves to the spool's
`refused` table, kept for an operator, so one bad record never blocks the others.
"""
from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import threading
import time
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import grpc
import structlog

from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc
from tokenserve.usage import UsageRecord, from_json, to_json, to_pb


# Lazy: resolved at first use, after configure_logging (JSON lines).
log = structlog.get_logger(component="spool")


# How durable a record is when `put` returns (the services' --spool-durability flag).
#   "process": committed to the write-ahead log without waiting for the disk (~20 us): it
#     survives the service crashing or being killed; a background flush puts it on disk
#     within FLUSH_SECONDS (a machine crash in that window can lose it).
#   "disk": on disk (fsync) before `put` returns; records that arrive while a commit is in
#     progress share the next commit's fsync (group commit), so concurrent requests do not
#     queue behind one fsync each.
DURABILITIES = ("process", "disk")
FLUSH_SECONDS = 0.05


class UsageSpool:
    def __init__(self, path: str | Path, durability: str = "process"):
        if durability not in DURABILITIES:
            raise ValueError(f"durability must be one of {DURABILITIES}, got {durability!r}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.durability = durability
        # One connection, used from the event loop and from the commit/flush threads.
        self._lock = threading.Lock()
        # The WAL file's descriptor and `_closed`, for the flusher: an fsync (milliseconds on
        # some disks) never holds the connection's lock, which every request's insert takes.
        self._fsync_lock = threading.Lock()
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=" + ("FULL" if durability == "disk" else "NORMAL"))
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._conn.execute("CREATE TABLE IF NOT EXISTS spool (seq INTEGER PRIMARY KEY"
                           " AUTOINCREMENT, event_id TEXT UNIQUE NOT NULL, record TEXT NOT NULL)")
        self._conn.execute("CREATE TABLE IF NOT EXISTS refused (event_id TEXT PRIMARY KEY,"
                           " record TEXT NOT NULL, reason TEXT NOT NULL)")
        # "process": the WAL file, fsynced by the flusher thread after each burst of writes.
        self._wal = (os.open(f"{path}-wal", os.O_RDONLY | os.O_CREAT, 0o600)
                     if durability == "process" else None)
        self._dirty = threading.Event()
        self._closed = False
        self._flusher = None
        if self._wal is not None:
            self._flusher = threading.Thread(target=self._flush_loop, name="spool-flush",
                                             daemon=True)
            self._flusher.start()
        # "disk": records waiting for the next group commit, and that commit's waiters.
        self._pending: list[tuple[UsageRecord, asyncio.Future]] = []
        self._committing = False

    def append(self, record: UsageRecord) -> None:
        """Stores `record` as durably as the spool's durability says, blocking the caller
        for the commit. The same event id twice is stored once."""
        self._insert([record])

    async def put(self, record: UsageRecord) -> None:
        """`append` for the event loop: with "disk" durability it waits for a group commit
        on a worker thread instead of blocking the loop for an fsync."""
        if self.durability == "process":
            self._insert([record])
            return
        done = asyncio.get_running_loop().create_future()
        self._pending.append((record, done))
        if not self._committing:
            self._committing = True
            asyncio.create_task(self._commit_pending())
        await done

    async def _commit_pending(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    await asyncio.to_thread(self._insert, [r for r, _ in batch])
                except Exception as e:  # noqa: BLE001 - each waiter hears of the failure
                    for _, done in batch:
                        done.done() or done.set_exception(e)
                else:
                    for _, done in batch:
                        done.done() or done.set_result(None)
        finally:
            self._committing = False

    def _insert(self, records: list[UsageRecord]) -> None:
        rows = [(r.event_id, to_json(r)) for r in records]
        with self._lock, self._conn:
            self._conn.execute("BEGIN")
            self._conn.executemany("INSERT OR IGNORE INTO spool (event_id, record) VALUES (?, ?)",
                                   rows)
        if self._wal is not None:
            self._dirty.set()

    def _flush_loop(self) -> None:
        while True:
            self._dirty.wait()
            if self._closed:
                return
            time.sleep(FLUSH_SECONDS)  # one fsync for every record of this burst
            self._dirty.clear()
            self.flush()

    def flush(self) -> None:
        """Puts every committed record on disk now."""
        if self._wal is not None:
            with self._fsync_lock:
                if not self._closed:
                    os.fsync(self._wal)

    def oldest(self, limit: int) -> list[tuple[int, UsageRecord]]:
        with self._lock:
            rows = self._conn.execute("SELECT seq, record FROM spool ORDER BY seq LIMIT ?",
                                      (limit,)).fetchall()
        return [(seq, from_json(text)) for seq, text in rows]

    def delete(self, seqs: Sequence[int]) -> None:
        with self._lock:
            self._conn.executemany("DELETE FROM spool WHERE seq = ?", [(s,) for s in seqs])

    def refuse(self, seq: int, reason: str) -> None:
        """Moves one record out of the send queue into `refused` (one transaction)."""
        with self._lock, self._conn:
            self._conn.execute("BEGIN")
            self._conn.execute("INSERT OR REPLACE INTO refused (event_id, record, reason)"
                               " SELECT event_id, record, ? FROM spool WHERE seq = ?",
                               (reason, seq))
            self._conn.execute("DELETE FROM spool WHERE seq = ?", (seq,))

    def refused(self) -> list[tuple[UsageRecord, str]]:
        with self._lock:
            rows = self._conn.execute("SELECT record, reason FROM refused").fetchall()
        return [(from_json(text), reason) for text, reason in rows]

    def __len__(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM spool").fetchone()[0]

    def close(self) -> None:
        self.flush()
        with self._lock, self._fsync_lock:
            self._closed = True
            self._conn.close()
            if self._wal is not None:
                os.close(self._wal)
        self._dirty.set()  # the flusher wakes, sees closed and ends


# How long the sender waits, once woken by a new record, for more before it sends: one
# RecordUsage call then carries every request that ended in that time (a call costs the
# service's event loop about as much as a whole request's other work), and the meter sees a
# record this much later. The record is in the spool already, so nothing waits for the send.
LINGER_SECONDS = 0.05


# Sends a batch; returns once the meter has stored it (raises when it has not).
SendFn = Callable[[list[UsageRecord]], Awaitable[None]]


class Refused(Exception):
    """The meter refused the batch for good because of one record (`index` in the batch)."""

    def __init__(self, index: int, reason: str):
        super().__init__(reason)
        self.index, self.reason = index, reason


_REFUSED_EVENT = re.compile(r"^events\[(\d+)\]")


async def send_usage(stub: meter_pb2_grpc.MeterServiceStub, records: list[UsageRecord],
                     timeout: float) -> None:
    """One RecordUsage call for `records` (a SendFn body: raises when the meter has not
    stored them; Refused when it names the record it will never take)."""
    try:
        await stub.RecordUsage(
            meter_pb2.RecordUsageRequest(events=[to_pb(r) for r in records]), timeout=timeout)
    except grpc.RpcError as e:
        details = (e.details() or "") if hasattr(e, "details") else ""
        m = _REFUSED_EVENT.match(details)
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT and m and int(m.group(1)) < len(records):
            raise Refused(int(m.group(1)), details) from None
        raise


class SpoolSender:
    def __init__(self, spool: UsageSpool, send: SendFn, *, batch_size: int = 500,
                 min_backoff: float = 0.2, max_backoff: float = 30.0,
                 linger: float = LINGER_SECONDS,
                 on_sent: Callable[[int], None] | None = None):
        self._spool = spool
        self._linger = linger
        self._send = send
        self._batch_size = batch_size
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._on_sent = on_sent
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.backoff = 0.0

    def notify(self) -> None:
        """Call after append: the sender wakes at once instead of at its next retry."""
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="usage-sender")

    async def send_pending(self) -> int:
        """Sends everything spooled now, batch by batch; returns events sent. Raises on the
        first failed batch (those events stay spooled)."""
        sent = 0
        # SQLite reads and the JSON decoding run on a worker thread: after an outage a batch
        # is hundreds of records, tens of milliseconds the event loop keeps for requests.
        while batch := await asyncio.to_thread(self._spool.oldest, self._batch_size):
            try:
                await self._send([r for _, r in batch])
            except Refused as e:
                seq, record = batch[e.index]
                self._spool.refuse(seq, e.reason)
                log.error("usage_record_refused", event_id=record.event_id,
                          request_id=record.request_id, reason=e.reason[:300])
                continue
            # At once, with no await between the meter's answer and the delete: a sender
            # stopped here would send the batch again.
            self._spool.delete([seq for seq, _ in batch])
            sent += len(batch)
            if self._on_sent:
                self._on_sent(len(batch))
        return sent

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.send_pending()
                self.backoff = 0.0
                await self._wake.wait()
                # the records of the next few milliseconds' requests go in the same call
                await asyncio.sleep(self._linger)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - meter down or refusing: retry later
                self.backoff = min(self._max_backoff, max(self._min_backoff, self.backoff * 2))
                log.warning("usage_send_failed", error_type=type(e).__name__,
                            pending=await asyncio.to_thread(len, self._spool),
                            retry_in_seconds=self.backoff)
                # New events do not shorten the backoff: the meter is what we wait for.
                await asyncio.sleep(self.backoff)

    async def stop(self, flush_timeout: float = 5.0) -> None:
        """Stops the loop, then tries once more to send what is spooled (bounded)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        try:
            await asyncio.wait_for(self.send_pending(), flush_timeout)
        except Exception as e:  # noqa: BLE001 - left in the spool for the next start
            log.warning("usage_flush_incomplete", error_type=type(e).__name__,
                        pending=len(self._spool))
