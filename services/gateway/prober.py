"""Re-probes ejected engine replicas (grpc.health.v1 Check) when their backoff ends.

One task per gateway: it sleeps until the next backoff ends or a new ejection wakes it,
checks every due replica at once, and reports each answer to the ReplicaHealth policy.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import structlog

from services.gateway import metrics
from services.gateway.health import ReplicaHealth

log = structlog.get_logger(component="prober")

# (endpoint, timeout seconds) -> whether it answered SERVING
Check = Callable[[str, float], Awaitable[bool]]


class Prober:
    def __init__(self, health: ReplicaHealth, check: Check, *, timeout: float = 1.0):
        self._health = health
        self._check = check
        self._timeout = timeout
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._probes: set[asyncio.Task] = set()

    def on_eject(self, endpoint: str, reason: str) -> None:
        """ReplicaHealth's listener: counts the ejection and wakes the loop."""
        metrics.REPLICA_EJECTIONS.inc()
        log.warning("engine_replica_ejected", endpoint=endpoint, reason=reason)
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._probes) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            for endpoint in self._health.due_probes():
                task = asyncio.get_running_loop().create_task(self._probe(endpoint))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)
            delay = self._health.next_probe_in()
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def _probe(self, endpoint: str) -> None:
        serving = await self._check(endpoint, self._timeout)
        self._health.on_probe(endpoint, serving)
        if serving:
            log.info("engine_replica_readmitted", endpoint=endpoint)
        self._wake.set()  # its next backoff (when still out) may be the soonest
