"""Ledgers on a real SQLite file and on a real PostgreSQL (tests/postgres_fixture.py: skipped
without a server, except in CI where that fails)."""
from __future__ import annotations

import pytest

from services.meter.store import Ledger
from tests.postgres_fixture import postgres_url  # noqa: F401  (pytest fixture)
from tokenserve.usage import Source, UsageRecord


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_location(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "meter.db")
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def ledger(ledger_location):
    led = Ledger.open(ledger_location)
    yield led
    led.close()


def event(event_id: str, request_id: str | None = None, source: Source = Source.GATEWAY, **kw):
    fields = dict(tenant_id="t1", app="app", model="m", model_version="v1", tier="free",
                  prompt_tokens=10, completion_tokens=5, cached_tokens=0,
                  started_at=1000.0, finished_at=1001.0)
    fields.update(kw)
    if "started_at" not in kw:  # keep the default start before an early finish
        fields["started_at"] = min(fields["started_at"], fields["finished_at"])
    return UsageRecord(event_id=event_id,
                       request_id=f"r-{event_id}" if request_id is None else request_id,
                       source=source, **fields)
