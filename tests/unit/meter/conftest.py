"""Ledgers on a real SQLite file, and on PostgreSQL when TOKENSERVE_TEST_POSTGRES_URL names a
reachable server (a throw-away database: the tests drop the table)."""
from __future__ import annotations

import os

import pytest

from services.meter.store import Ledger
from services.meter.usage import Source, UsageEvent

POSTGRES_URL_ENV = "TOKENSERVE_TEST_POSTGRES_URL"


def _postgres_ledger():
    url = os.environ.get(POSTGRES_URL_ENV)
    if not url:
        pytest.skip(f"PostgreSQL ledger not tested: set {POSTGRES_URL_ENV}=postgresql://..."
                    " to a throw-away database")
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            conn.execute("DROP TABLE IF EXISTS usage_events")
    except psycopg.OperationalError as e:
        pytest.skip(f"PostgreSQL at {POSTGRES_URL_ENV} is not reachable: {e}")
    return Ledger.open(url)


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger(request, tmp_path):
    led = (Ledger.open(str(tmp_path / "meter.db")) if request.param == "sqlite"
           else _postgres_ledger())
    yield led
    led.close()


def event(event_id: str, request_id: str | None = None, source: Source = Source.GATEWAY, **kw):
    fields = dict(tenant_id="t1", app="app", model="m", model_version="v1", tier="free",
                  prompt_tokens=10, completion_tokens=5, cached_tokens=0,
                  started_at=1000.0, finished_at=1001.0)
    fields.update(kw)
    if "started_at" not in kw:  # keep the default start before an early finish
        fields["started_at"] = min(fields["started_at"], fields["finished_at"])
    return UsageEvent(event_id=event_id, request_id=f"r-{event_id}" if request_id is None else request_id,
                      source=source, **fields)
