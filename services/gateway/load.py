"""Engine load signals, as this gateway last heard them.

Each engine pushes its load over a server-streaming `WatchLoad` RPC (engine.proto; why a
stream: services/engine/load.py). `LoadSubscriptions` keeps one subscriber task per engine
endpoint the gateway routes to (registered in etcd or given with --engine; `sync` starts and
stops tasks as engines come and go), each writing every report to the `LoadBoard`. Readers
(the degradation level, replica choice) ask the board: `get(endpoint)` and `all()` return
only fresh entries: a report older than `stale_after` seconds (the engine pushes at least
once a second) is not trusted, as if the engine reported nothing.

No grpc here: the subscriber reads an async iterator of `EngineLoad` (downstream.py's
`EngineClient.watch_load`) and sees failures as ServiceErrors.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterable

import structlog

from controlplane.snapshot import ConfigSnapshot
from services.gateway.config import StaticEngine
from tokenserve.runtime.errors import ServiceError

log = structlog.get_logger(component="load")

STALE_AFTER_S = 3.0


@dataclass(frozen=True)
class EngineLoad:
    """One engine's report (latencies over the engine's recent window; 0: no sample)."""

    endpoint: str
    model: str
    version: str
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    tokens_per_s: float
    watts: float
    watts_estimated: bool
    received_at: float  # the board's clock (monotonic seconds)

    @property
    def kv_use(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class LoadBoard:
    """The latest EngineLoad per endpoint; stale entries are not handed out."""

    def __init__(self, stale_after: float = STALE_AFTER_S,
                 clock: Callable[[], float] = time.monotonic):
        self.stale_after = stale_after
        self.clock = clock
        self._latest: dict[str, EngineLoad] = {}

    def put(self, load: EngineLoad) -> None:
        self._latest[load.endpoint] = load

    def forget(self, endpoint: str) -> None:
        self._latest.pop(endpoint, None)

    def _fresh(self, load: EngineLoad | None, now: float) -> bool:
        return load is not None and now - load.received_at <= self.stale_after

    def get(self, endpoint: str) -> EngineLoad | None:
        """The engine's last report, or None when it has none younger than stale_after."""
        load = self._latest.get(endpoint)
        return load if self._fresh(load, self.clock()) else None

    def all(self) -> list[EngineLoad]:
        """Every fresh report, by endpoint."""
        now = self.clock()
        return [v for _, v in sorted(self._latest.items()) if self._fresh(v, now)]


def engine_endpoints(snap: ConfigSnapshot, static: Iterable[StaticEngine]) -> set[str]:
    """Every engine the router can send to: registered in etcd or given with --engine."""
    return {e.endpoint for e in snap.engines.values()} | {e.endpoint for e in static}


Watch = Callable[[str], AsyncIterator[EngineLoad]]


class LoadSubscriptions:
    """One task per engine endpoint, reading its load stream into the board; a broken or
    silent stream is re-opened with backoff (0.25 s doubling to 2 s, jittered) while the
    endpoint is still wanted."""

    def __init__(self, board: LoadBoard, watch: Watch, *, silence_timeout: float = 5.0,
                 max_backoff: float = 2.0):
        self.board = board
        self._watch = watch
        self._silence = silence_timeout
        self._max_backoff = max_backoff
        self._tasks: dict[str, asyncio.Task] = {}

    @property
    def endpoints(self) -> set[str]:
        return set(self._tasks)

    def sync(self, endpoints: set[str]) -> None:
        """Starts a subscriber for each new endpoint and stops those no longer listed."""
        for ep in set(self._tasks) - endpoints:
            self._tasks.pop(ep).cancel()
            self.board.forget(ep)
        for ep in endpoints - set(self._tasks):
            self._tasks[ep] = asyncio.get_running_loop().create_task(self._follow(ep))

    async def close(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, endpoint: str) -> None:
        backoff, failures = 0.25, 0
        while True:
            stream = self._watch(endpoint)
            try:
                while True:
                    # a stream that goes quiet (an engine host gone without a reset) is re-opened
                    load = await asyncio.wait_for(anext(stream), self._silence)
                    self.board.put(load)
                    if failures:
                        log.info("engine_load_resumed", endpoint=endpoint)
                    backoff, failures = 0.25, 0
            except (ServiceError, StopAsyncIteration, asyncio.TimeoutError) as e:
                failures += 1
                if failures == 1:  # once per outage, not once per retry
                    log.warning("engine_load_lost", endpoint=endpoint,
                                error=getattr(e, "message", type(e).__name__))
            finally:
                await stream.aclose()
            await asyncio.sleep(backoff * (1 + random.random() / 2))
            backoff = min(backoff * 2, self._max_backoff)
