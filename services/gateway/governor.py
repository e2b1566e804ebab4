"""The gateway's degradation loop: every `tick` seconds (250 ms) it follows the engines the
router can reach (one load subscription each), computes the level from the fresh reports on
the LoadBoard with the live `degradation` and `power_budget` documents, and exports it (the
`tokenserve_gateway_degradation_level` gauge, a per-signal ratio gauge). Admission asks
`decide(tier)` per request, which reads the level and never waits.

A timer rather than a callback per report: the hold time has to run out even when no report
arrives, and one tick reads every engine's latest at once. The engine set comes from the same
snapshot the router reads, so both agree on which engines exist.

`changed` is set when the level changes; the gateway then rewrites its etcd registration
(`gateways/<id>`, lease-bound) with the level and its reason, which `tsctl status` shows.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterable

import structlog

from controlplane.snapshot import ConfigSnapshot
from services.gateway import metrics
from services.gateway.config import StaticEngine
from services.gateway.degradation import Decision, Ladder, LevelState, Signals, decide
from services.gateway.load import LoadBoard, LoadSubscriptions, engine_endpoints

log = structlog.get_logger(component="degradation")

TICK_S = 0.25


class Governor:
    def __init__(self, snapshot: Callable[[], ConfigSnapshot], static_engines: Iterable[StaticEngine],
                 board: LoadBoard, subscriptions: LoadSubscriptions | None, *,
                 tick: float = TICK_S, clock: Callable[[], float] = time.monotonic):
        self._snapshot = snapshot
        self._static = tuple(static_engines)
        self.board = board
        self._subscriptions = subscriptions
        self.tick = tick
        self._clock = clock
        self._ladder = Ladder()
        self.state = LevelState()
        self.changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        metrics.DEGRADATION_LEVEL.set(0)

    def step(self) -> LevelState:
        """One tick: follow the engines, recompute the level, export it."""
        snap = self._snapshot()
        if self._subscriptions is not None:
            self._subscriptions.sync(engine_endpoints(snap, self._static))
        before = self.state.level
        self.state = self._ladder.update(snap.degradation, snap.power_budget,
                                         Signals.of(self.board.all()), self._clock())
        metrics.DEGRADATION_LEVEL.set(self.state.level)
        for name, ratio in self.state.ratios.items():
            metrics.DEGRADATION_SIGNAL_RATIO.labels(name).set(round(ratio, 4))
        if self.state.level != before:
            log.warning("degradation_level_changed", level=self.state.level, previous=before,
                        reason=self.state.reason or "signals below the thresholds")
            self.changed.set()
        return self.state

    def decide(self, tier: str) -> Decision:
        return decide(self._snapshot().degradation, self.state, tier)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - the loop must outlive a bad tick
                log.error("degradation_step_failed", exc_type=type(e).__name__, error=str(e)[:200])
            await asyncio.sleep(self.tick)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._subscriptions is not None:
            await self._subscriptions.close()
