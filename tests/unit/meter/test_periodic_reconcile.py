"""The meter's own reconcile on a real ledger: it publishes the drift of the last window
(leaving out the settle time at its end) and keeps doing so on its interval."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from services.meter.drift import KINDS, PeriodicReconcile, publish
from services.meter.store import Ledger
from services.meter.usage import Reconciliation
from tests.unit.meter.conftest import event
from tokenserve.usage import Source

NOW = 1_000_000.0


@pytest.fixture(autouse=True)
def no_drift_yet():
    publish(Reconciliation(matched=0, mismatches=()), 0.0)


def drift() -> dict[str, float]:
    return {k: REGISTRY.get_sample_value("tokenserve_meter_reconcile_drift_records",
                                         {"kind": k}) for k in KINDS}


def last_run() -> float:
    return REGISTRY.get_sample_value("tokenserve_meter_reconcile_last_run_timestamp_seconds")


def test_a_run_publishes_the_windows_drift_without_the_settle_time(ledger_location):
    led = Ledger.open(ledger_location)
    led.record([
        event("g1", request_id="ok", finished_at=NOW - 600),
        event("e1", request_id="ok", source=Source.ENGINE, finished_at=NOW - 600),
        event("g2", request_id="no-engine", finished_at=NOW - 500),
        event("g3", request_id="diff", finished_at=NOW - 400, prompt_tokens=10),
        event("e3", request_id="diff", source=Source.ENGINE, finished_at=NOW - 400,
              prompt_tokens=11),
        event("g4", request_id="just-ended", finished_at=NOW - 5),  # engine's still coming
        event("g5", request_id="long-ago", finished_at=NOW - 7200),
    ])
    periodic = PeriodicReconcile(ledger_location, interval=60, window=3600, settle=30,
                                 clock=lambda: NOW)

    async def run():
        try:
            return await periodic.run_once()
        finally:
            await periodic.close()

    result = asyncio.run(run())
    assert result.matched == 1
    assert drift() == {"missing_engine": 1, "missing_gateway": 0, "mismatch": 1}
    assert last_run() == NOW
    led.close()


def test_it_runs_again_on_its_interval_and_sees_new_records(ledger_location):
    led = Ledger.open(ledger_location)
    led.record([event("g1", request_id="r", finished_at=NOW - 100)])
    periodic = PeriodicReconcile(ledger_location, interval=0.05, window=3600, settle=0,
                                 clock=lambda: NOW)

    async def until(condition):
        for _ in range(200):
            if condition():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"not reached: {drift()}")

    async def run():
        periodic.start()
        try:
            await until(lambda: drift()["missing_engine"] == 1)
            led.record([event("e1", request_id="r", source=Source.ENGINE,
                              finished_at=NOW - 100)])
            await until(lambda: drift()["missing_engine"] == 0)
        finally:
            await periodic.close()

    asyncio.run(run())
    led.close()


def test_the_flags_default_to_a_minute_over_an_hour_and_zero_turns_it_off():
    from services.meter.main import parse_args

    c = parse_args([])
    assert (c.reconcile_interval_seconds, c.reconcile_window_seconds) == (60.0, 3600.0)
    assert parse_args(["--reconcile-interval-seconds", "0"]).reconcile_interval_seconds == 0
    with pytest.raises(SystemExit):
        parse_args(["--reconcile-interval-seconds", "-1"])
