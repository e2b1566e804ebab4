"""The reconcile drift metric, and the periodic reconcile that keeps it live.

`tokenserve_meter_reconcile_drift_records{kind}` holds the findings of the last reconcile:
the meter's own, every `--reconcile-interval-seconds` over the last
`--reconcile-window-seconds`, or one an operator ran (`Reconcile`, `tsctl usage
reconcile`), whichever finished last. The periodic one leaves out the last SETTLE_SECONDS:
the other source's record of a request that just ended may still be in its sender's spool,
and reporting it missing every minute would make drift that is not there.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import structlog
from prometheus_client import Gauge

from services.meter.reconcile import reconcile
from services.meter.store import Ledger
from services.meter.usage import Reconciliation, UsageQuery

DRIFT = Gauge("tokenserve_meter_reconcile_drift_records",
              "Disagreements the last reconcile found, by kind (missing_engine,"
              " missing_gateway, mismatch)", ["kind"])
LAST_RUN = Gauge("tokenserve_meter_reconcile_last_run_timestamp_seconds",
                 "When the last reconcile finished (Unix seconds)")
KINDS = ("missing_engine", "missing_gateway", "mismatch")
SETTLE_SECONDS = 30.0

log = structlog.get_logger(component="reconcile")


def publish(result: Reconciliation, now: float) -> None:
    drift = result.drift()
    for kind in KINDS:
        DRIFT.labels(kind).set(drift.get(kind, 0))
    LAST_RUN.set(now)


class PeriodicReconcile:
    """Reconciles [now - settle - window, now - settle) every `interval` seconds and
    publishes the drift. It reads through its own ledger connection on its own thread, so
    a reconcile of a busy hour never holds up RecordUsage batches."""

    def __init__(self, location: str, *, interval: float, window: float,
                 settle: float = SETTLE_SECONDS, clock: Callable[[], float] = time.time):
        self._location = location
        self.interval, self.window, self.settle = interval, window, settle
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reconcile")
        self._ledger: Ledger | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def run_once(self) -> Reconciliation:
        end = self._clock() - self.settle
        q = UsageQuery(start=max(0.0, end - self.window), end=end)
        result = await asyncio.get_running_loop().run_in_executor(
            self._executor, self._reconcile, q)
        publish(result, self._clock())
        return result

    def _reconcile(self, q: UsageQuery) -> Reconciliation:
        if self._ledger is None:
            self._ledger = Ledger.open(self._location)
        try:
            return reconcile(self._ledger.requests_finished_in(q))
        except Exception:
            self._ledger.close()  # a lost connection: the next run opens a new one
            self._ledger = None
            raise

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                result = await self.run_once()
            except Exception as e:  # noqa: BLE001 - the ledger may be down; try next time
                log.warning("periodic_reconcile_failed", exc_type=type(e).__name__,
                            error=str(e))
                continue
            log.info("periodic_reconcile", matched=result.matched, drift=result.drift(),
                     window_seconds=self.window)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._ledger is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor,
                                                             self._ledger.close)
        self._executor.shutdown(wait=True)
