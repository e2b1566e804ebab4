"""The engine's load reports: the sliding window, the power meter, and the publisher that
pushes at once, on change (at most every min_interval) and at least every interval."""
from __future__ import annotations

import asyncio
import dataclasses
from contextlib import aclosing

from services.engine.energy import EstimatedPower
from services.engine.load import LoadPublisher, LoadSample, LoadWindow, PowerMeter, percentile


class Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_percentiles_and_rate_cover_the_recent_window_only():
    clock = Clock(100.0)
    w = LoadWindow(latency_window=30.0, rate_window=5.0, clock=clock)
    for i in range(100):
        w.add_ttft(0.01 * (i + 1), at=80.0 + i * 0.1)  # 0.01 .. 1.00 s
        w.add_itl(0.02, at=80.0 + i * 0.1)
    w.add_tokens(400, at=96.0)
    w.add_tokens(100, at=99.0)
    ttft50, ttft99, itl50, itl99, rate = w.read()
    assert (ttft50, ttft99, itl50, itl99) == (0.5, 0.99, 0.02, 0.02)
    assert rate == 100.0  # 500 tokens over the 5 s window
    clock.now = 102.0  # the 96.0 tokens left the rate window
    assert w.read()[4] == 20.0
    clock.now = 200.0
    assert w.read() == (0.0, 0.0, 0.0, 0.0, 0.0)
    assert percentile([], 99) == 0.0 and percentile([3.0], 50) == 3.0


def test_power_from_an_estimate_and_from_a_counter():
    assert PowerMeter(EstimatedPower(15.0)).watts() == 15.0

    class Counter:
        estimated = False
        joules = 1000.0

        def read_joules(self):
            return self.joules

    clock, counter = Clock(), Counter()
    meter = PowerMeter(counter, clock=clock)
    assert meter.watts() == 0.0 and not meter.estimated
    clock.now, counter.joules = 2.0, 1100.0
    assert meter.watts() == 50.0
    clock.now, counter.joules = 2.1, 1200.0  # too soon to re-read: the last figure stands
    assert meter.watts() == 50.0


def sample(waiting: int = 0) -> LoadSample:
    return LoadSample(waiting, 0, 0, 100, 0, 0, 0, 0, 0, 15.0, True)


async def test_the_publisher_pushes_at_once_on_change_and_every_interval():
    state = {"s": sample()}
    pub = LoadPublisher(lambda: state["s"], interval=0.4, min_interval=0.1)
    loop = asyncio.get_running_loop()
    got: list[tuple[float, int]] = []
    t0 = loop.time()

    async def follow():
        async with aclosing(pub.watch()) as reports:
            async for r in reports:
                got.append((loop.time() - t0, r.waiting))

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.05)
    assert len(got) == 1 and got[0][0] < 0.05 and pub.subscribers == 1  # at once
    state["s"] = sample(waiting=5)
    pub.poke()
    await asyncio.sleep(0.2)
    assert [w for _, w in got] == [0, 5] and got[1][0] < 0.15  # on change, min_interval after
    await asyncio.sleep(0.5)
    assert [w for _, w in got][:3] == [0, 5, 5]  # nothing moved: the interval's report
    pub.close()
    await asyncio.wait_for(task, 1)  # draining ends every watch
    assert pub.subscribers == 0


async def test_subscribers_share_one_sample():
    calls = []

    def take():
        calls.append(1)
        return sample()

    pub = LoadPublisher(take, interval=10, min_interval=1.0)
    a, b = pub.watch(), pub.watch()
    first = await anext(a), await anext(b)
    assert first[0] == first[1] and len(calls) == 1
    await a.aclose()
    await b.aclose()
    assert dataclasses.replace(first[0], waiting=1).moved_from(first[0])
