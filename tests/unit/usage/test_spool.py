"""The usage spool on a real SQLite file and its sender against a fake meter call."""
from __future__ import annotations

import asyncio

import pytest

from tokenserve.spool import SpoolSender, UsageSpool
from tokenserve.usage import Source, UsageRecord


def rec(i: int) -> UsageRecord:
    return UsageRecord(event_id=f"ev-{i}", request_id=f"r-{i}", source=Source.GATEWAY,
                       tenant_id="acme", app="",
                       model="m", model_version="v1", tier="free", prompt_tokens=3,
                       completion_tokens=i, cached_tokens=0, status="OK", started_at=1.0,
                       finished_at=2.0)


class FakeMeter:
    """Stores batches; fails while `down` is set."""

    def __init__(self):
        self.batches: list[list[UsageRecord]] = []
        self.down = False
        self.got = asyncio.Event()

    async def send(self, batch):
        if self.down:
            raise ConnectionError("meter down")
        self.batches.append(batch)
        self.got.set()

    @property
    def ids(self):
        return [r.event_id for b in self.batches for r in b]


def test_records_survive_reopening_and_duplicates_are_kept_once(tmp_path):
    spool = UsageSpool(tmp_path / "s.db")
    spool.append(rec(1))
    spool.append(rec(2))
    spool.append(rec(1))
    spool.close()
    spool = UsageSpool(tmp_path / "s.db")
    assert [r for _, r in spool.oldest(10)] == [rec(1), rec(2)]
    spool.close()


async def test_sender_ships_in_batches_and_deletes_only_what_was_acked(tmp_path):
    spool = UsageSpool(tmp_path / "s.db")
    for i in range(7):
        spool.append(rec(i))
    meter = FakeMeter()
    sender = SpoolSender(spool, meter.send, batch_size=3)
    assert await sender.send_pending() == 7
    assert [len(b) for b in meter.batches] == [3, 3, 1]
    assert len(spool) == 0
    spool.append(rec(8))
    meter.down = True
    with pytest.raises(ConnectionError):
        await sender.send_pending()
    assert len(spool) == 1  # kept for the next try
    spool.close()


async def test_background_sender_retries_until_the_meter_is_back(tmp_path):
    spool = UsageSpool(tmp_path / "s.db")
    meter = FakeMeter()
    meter.down = True
    sender = SpoolSender(spool, meter.send, batch_size=10, min_backoff=0.01, max_backoff=0.05)
    sender.start()
    spool.append(rec(1))
    sender.notify()
    while sender.backoff == 0.0:  # the first attempt failed and a retry is scheduled
        await asyncio.sleep(0.01)
    meter.down = False
    await asyncio.wait_for(meter.got.wait(), 10)
    await sender.stop()
    assert meter.ids == ["ev-1"] and len(spool) == 0
    spool.close()


async def test_stop_flushes_what_is_left(tmp_path):
    spool = UsageSpool(tmp_path / "s.db")
    meter = FakeMeter()
    sender = SpoolSender(spool, meter.send)
    spool.append(rec(1))  # appended without notify: only the stop flush sends it
    await sender.stop(flush_timeout=5)
    assert meter.ids == ["ev-1"] and len(spool) == 0
    spool.close()


def test_a_record_put_survives_the_writer_being_killed_at_once(tmp_path):
    """"process" durability: once `append` returns, a SIGKILL of the service loses nothing."""
    import signal
    import subprocess
    import sys
    import textwrap
    path = tmp_path / "s.db"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parents[3])!r})
        from tests.unit.usage.test_spool import rec
        from tokenserve.spool import UsageSpool
        spool = UsageSpool({str(path)!r}, "process")
        for i in range(20):
            spool.append(rec(i))
        os.kill(os.getpid(), signal.SIGKILL)
        """)])
    assert child.wait(60) == -signal.SIGKILL
    spool = UsageSpool(path)
    assert [r.event_id for _, r in spool.oldest(100)] == [f"ev-{i}" for i in range(20)]
    spool.close()


async def test_disk_durability_commits_concurrent_records_together(tmp_path, monkeypatch):
    spool = UsageSpool(tmp_path / "s.db", "disk")
    commits = []
    insert = spool._insert
    monkeypatch.setattr(spool, "_insert", lambda rows: (commits.append(len(rows)), insert(rows)))
    await asyncio.gather(*(spool.put(rec(i)) for i in range(50)))
    assert sum(commits) == 50 and len(commits) < 50  # group commits, none lost
    assert len(spool) == 50
    spool.close()
    spool = UsageSpool(tmp_path / "s.db", "disk")
    assert len(spool) == 50
    spool.close()


def test_an_unknown_durability_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="durability must be one of"):
        UsageSpool(tmp_path / "s.db", "eventually")
