"""Usage records on local disk until the meter has them (at-least-once; the meter dedupes).

The gateway and every engine each keep one spool and one sender (this module, shared).
`UsageSpool.append` commits to a SQLite file (WAL, synchronous=FULL) before the service
sends the last message of a request, so a crash after that loses nothing. `SpoolSender`
ships the oldest events in batches and deletes them only after the meter acknowledged them;
while the meter is down it retries with exponential backoff. A record the meter refuses for
good (INVALID_ARGUMENT naming `events[i]`: say its tenant was deleted) moves to the spool's
`refused` table, kept for an operator, so one bad record never blocks the others.
"""
from __future__ import annotations

import asyncio
import re
import sqlite3
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import grpc
import structlog

from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc
from tokenserve.usage import UsageRecord, from_json, to_json, to_pb


# Lazy: resolved at first use, after configure_logging (JSON lines).
log = structlog.get_logger(component="spool")


class UsageSpool:
    def __init__(self, path: str | Path):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._conn.execute("CREATE TABLE IF NOT EXISTS spool (seq INTEGER PRIMARY KEY"
                           " AUTOINCREMENT, event_id TEXT UNIQUE NOT NULL, record TEXT NOT NULL)")
        self._conn.execute("CREATE TABLE IF NOT EXISTS refused (event_id TEXT PRIMARY KEY,"
                           " record TEXT NOT NULL, reason TEXT NOT NULL)")

    def append(self, record: UsageRecord) -> None:
        """Durable on return. The same event id twice is stored once."""
        self._conn.execute("INSERT OR IGNORE INTO spool (event_id, record) VALUES (?, ?)",
                           (record.event_id, to_json(record)))

    def oldest(self, limit: int) -> list[tuple[int, UsageRecord]]:
        rows = self._conn.execute("SELECT seq, record FROM spool ORDER BY seq LIMIT ?",
                                  (limit,)).fetchall()
        return [(seq, from_json(text)) for seq, text in rows]

    def delete(self, seqs: Sequence[int]) -> None:
        self._conn.executemany("DELETE FROM spool WHERE seq = ?", [(s,) for s in seqs])

    def refuse(self, seq: int, reason: str) -> None:
        """Moves one record out of the send queue into `refused` (one transaction)."""
        with self._conn:
            self._conn.execute("BEGIN")
            self._conn.execute("INSERT OR REPLACE INTO refused (event_id, record, reason)"
                               " SELECT event_id, record, ? FROM spool WHERE seq = ?",
                               (reason, seq))
            self._conn.execute("DELETE FROM spool WHERE seq = ?", (seq,))

    def refused(self) -> list[tuple[UsageRecord, str]]:
        return [(from_json(text), reason) for text, reason in
                self._conn.execute("SELECT record, reason FROM refused").fetchall()]

    def __len__(self) -> int:
        return self._conn.execute("SELECT COUNT(*) FROM spool").fetchone()[0]

    def close(self) -> None:
        self._conn.close()


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
                 on_sent: Callable[[int], None] | None = None):
        self._spool = spool
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
        while batch := self._spool.oldest(self._batch_size):
            try:
                await self._send([r for _, r in batch])
            except Refused as e:
                seq, record = batch[e.index]
                self._spool.refuse(seq, e.reason)
                log.error("usage_record_refused", event_id=record.event_id,
                          request_id=record.request_id, reason=e.reason[:300])
                continue
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
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - meter down or refusing: retry later
                self.backoff = min(self._max_backoff, max(self._min_backoff, self.backoff * 2))
                log.warning("usage_send_failed", error_type=type(e).__name__,
                            pending=len(self._spool), retry_in_seconds=self.backoff)
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
