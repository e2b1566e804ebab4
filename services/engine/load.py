"""The engine's load as gateways see it: queue, batch, KV use, recent latency, tokens/s, watts.

Transport: a server-streaming `WatchLoad` RPC that each gateway keeps open to each engine.
Pushed rather than polled so a gateway hears of a growing queue within a quarter second
(a report goes out on change, at most 4 a second, and at least once a second), whatever its
own polling would be; one stream per gateway and engine over the channel Generate already
uses, with a cost independent of the request rate; and a stream that breaks tells the
gateway at once that the engine is gone. etcd never sees it (presence and policy only).

`LoadWindow` is fed on the step thread (by EngineMetrics) and read on the event loop, hence
its lock. `LoadPublisher` fans one sample out to every subscriber (sampled at most once per
`min_interval`, however many gateways watch). Pure Python: no torch, no grpc.
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable

LATENCY_WINDOW_S = 30.0
RATE_WINDOW_S = 5.0
# Latency samples kept per window: under heavy load the window holds the most recent ones.
MAX_SAMPLES = 4096


@dataclass(frozen=True)
class LoadSample:
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

    def moved_from(self, other: "LoadSample") -> bool:
        """The queue, the batch or the KV use changed (what makes a report go out early)."""
        return ((self.waiting, self.running, self.kv_blocks_used)
                != (other.waiting, other.running, other.kv_blocks_used))


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


class _Samples:
    """(time, value) pairs of the last `window` seconds, at most MAX_SAMPLES."""

    def __init__(self, window: float):
        self.window = window
        self.items: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)

    def trim(self, now: float) -> None:
        while self.items and self.items[0][0] < now - self.window:
            self.items.popleft()


class LoadWindow:
    """Recent TTFT and inter-token samples and generated-token counts."""

    def __init__(self, latency_window: float = LATENCY_WINDOW_S,
                 rate_window: float = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._ttft = _Samples(latency_window)
        self._itl = _Samples(latency_window)
        self._tokens = _Samples(rate_window)
        self.clock = clock
        self.latency_window = latency_window
        self.rate_window = rate_window

    # -- step thread -----------------------------------------------------------------------
    def add_ttft(self, seconds: float, at: float) -> None:
        with self._lock:
            self._ttft.items.append((at, seconds))

    def add_itl(self, seconds: float, at: float) -> None:
        with self._lock:
            self._itl.items.append((at, seconds))

    def add_tokens(self, count: int, at: float) -> None:
        if count:
            with self._lock:
                self._tokens.items.append((at, float(count)))

    # -- event loop ------------------------------------------------------------------------
    def read(self) -> tuple[float, float, float, float, float]:
        """(ttft p50, ttft p99, itl p50, itl p99, tokens/s) over the windows, now."""
        now = self.clock()
        with self._lock:
            for s in (self._ttft, self._itl, self._tokens):
                s.trim(now)
            ttft = sorted(v for _, v in self._ttft.items)
            itl = sorted(v for _, v in self._itl.items)
            tokens = sum(v for _, v in self._tokens.items)
        return (percentile(ttft, 50), percentile(ttft, 99), percentile(itl, 50),
                percentile(itl, 99), tokens / self.rate_window)


class PowerMeter:
    """Watts from an energy source (energy.py): joules read now minus joules at the last
    reading, over the time between. An estimated source gives its configured figure.

    Its own source instance (the step thread's one attributes joules to requests): the
    counters are read-only files, so two readers do not disturb each other."""

    def __init__(self, source, clock: Callable[[], float] = time.monotonic,
                 min_interval: float = 0.5):
        self.source = source
        self.estimated = bool(source.estimated)
        self._clock = clock
        self._min_interval = min_interval
        self._at = clock()
        self._joules = source.read_joules()
        self._watts = float(getattr(source, "watts", 0.0))

    def watts(self) -> float:
        now = self._clock()
        if now - self._at >= self._min_interval:
            joules = self.source.read_joules()
            self._watts = max(0.0, (joules - self._joules) / (now - self._at))
            self._at, self._joules = now, joules
        return self._watts


class LoadPublisher:
    """`watch()` yields the current sample at once, then when it moved (at most every
    `min_interval`) or `interval` has passed. `poke()` (on the event loop) says something
    may have changed; `close()` ends every watch (the engine is draining)."""

    def __init__(self, sample: Callable[[], LoadSample], *, interval: float = 1.0,
                 min_interval: float = 0.25, clock: Callable[[], float] = time.monotonic):
        self._sample = sample
        self.interval = interval
        self.min_interval = min_interval
        self._clock = clock
        self._subscribers: set[asyncio.Event] = set()
        self._cached: tuple[float, LoadSample] | None = None
        self.closed = False

    def poke(self) -> None:
        for ev in self._subscribers:
            ev.set()

    def close(self) -> None:
        self.closed = True
        self.poke()

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def current(self) -> LoadSample:
        """The sample now; subscribers woken together share one (taken at most every
        min_interval / 2)."""
        now = self._clock()
        if self._cached is not None and now - self._cached[0] < self.min_interval / 2:
            return self._cached[1]
        sample = self._sample()
        self._cached = (now, sample)
        return sample

    async def watch(self) -> AsyncIterator[LoadSample]:
        wake = asyncio.Event()
        self._subscribers.add(wake)
        last: LoadSample | None = None
        sent_at = -math.inf
        try:
            while not self.closed:
                wake.clear()  # before sampling: a poke from now on is not lost
                sample = self.current()
                if last is None or sample.moved_from(last) or self._clock() - sent_at >= self.interval:
                    yield sample
                    last, sent_at = sample, self._clock()
                wait = sent_at + self.interval - self._clock()
                if wait > 0:
                    try:
                        await asyncio.wait_for(wake.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
                gap = sent_at + self.min_interval - self._clock()
                if gap > 0 and not self.closed:
                    await asyncio.sleep(gap)
        finally:
            self._subscribers.discard(wake)


def engine_sampler(engine, window: LoadWindow, power: PowerMeter) -> Callable[[], LoadSample]:
    """The sample function of an AsyncEngine (engine_loop.py): the step thread's last
    published stats, the window's percentiles and rate, the power meter's watts."""
    def sample() -> LoadSample:
        st = engine.loop.stats
        ttft50, ttft99, itl50, itl99, rate = window.read()
        return LoadSample(waiting=engine.num_waiting, running=st.running,
                          kv_blocks_used=max(0, st.blocks_total - st.blocks_free),
                          kv_blocks_total=st.blocks_total, ttft_p50_s=ttft50, ttft_p99_s=ttft99,
                          itl_p50_s=itl50, itl_p99_s=itl99, tokens_per_s=rate,
                          watts=power.watts(), watts_estimated=power.estimated)
    return sample
