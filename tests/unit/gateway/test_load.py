"""The gateway's LoadBoard (fresh reports only) and its subscriptions (one per engine,
re-opened when a stream breaks), over a fake watch function (no grpc)."""
from __future__ import annotations

import asyncio
import dataclasses

from controlplane.schema import EngineRegistration
from controlplane.snapshot import ConfigSnapshot
from services.gateway.config import StaticEngine
from services.gateway.load import (EngineLoad, LoadBoard, LoadSubscriptions,
                                   engine_endpoints)
from tokenserve.runtime.errors import Unavailable


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(endpoint: str, at: float, waiting: int = 0) -> EngineLoad:
    return EngineLoad(endpoint, "m", "v1", waiting, 1, 10, 100, 0.1, 0.2, 0.01, 0.02, 50.0,
                      15.0, True, received_at=at)


def test_stale_reports_are_not_trusted():
    clock = Clock()
    board = LoadBoard(stale_after=3.0, clock=clock)
    board.put(report("a:1", at=100.0))
    board.put(report("b:1", at=98.0))
    assert board.get("a:1").kv_use == 0.1
    clock.now = 101.5
    assert [x.endpoint for x in board.all()] == ["a:1"]  # b is 3.5 s old
    assert board.get("b:1") is None and board.get("nobody:1") is None
    clock.now = 103.5
    assert board.all() == [] and board.get("a:1") is None


def test_the_engines_are_those_the_router_can_reach():
    reg = EngineRegistration("e0", "10.0.0.1:50053", "m", "v1", 8)
    snap = ConfigSnapshot.from_documents(1, {reg.key: reg})
    assert engine_endpoints(snap, [StaticEngine("m", "v1", "127.0.0.1:7")]) == {
        "10.0.0.1:50053", "127.0.0.1:7"}


async def test_subscriptions_follow_engines_and_reopen_broken_streams():
    board = LoadBoard()
    opened: list[str] = []
    broken = asyncio.Event()

    async def watch(endpoint: str):
        opened.append(endpoint)
        n = opened.count(endpoint)
        loop = asyncio.get_running_loop()
        yield report(endpoint, loop.time(), waiting=n)
        if endpoint == "a:1" and n == 1:
            broken.set()
            raise Unavailable("engine a:1 load: connection reset")
        await asyncio.sleep(3600)

    subs = LoadSubscriptions(board, watch, max_backoff=0.05)
    board.clock = asyncio.get_running_loop().time
    subs.sync({"a:1", "b:1"})
    await asyncio.wait_for(broken.wait(), 2)
    for _ in range(100):  # the broken stream is opened again after its backoff
        if opened.count("a:1") == 2 and board.get("a:1") and board.get("a:1").waiting == 2:
            break
        await asyncio.sleep(0.02)
    assert opened.count("a:1") == 2 and opened.count("b:1") == 1
    assert board.get("a:1").waiting == 2
    subs.sync({"b:1"})  # a:1 deregistered: its task stops and its report goes
    assert subs.endpoints == {"b:1"} and board.get("a:1") is None
    await subs.close()
    assert subs.endpoints == set()


async def test_a_silent_stream_is_reopened():
    board = LoadBoard()
    opened = []

    async def watch(endpoint: str):
        opened.append(endpoint)
        yield dataclasses.replace(report(endpoint, 0.0), received_at=asyncio.get_running_loop().time())
        await asyncio.sleep(3600)  # never another report: a host gone without a reset

    board.clock = asyncio.get_running_loop().time
    subs = LoadSubscriptions(board, watch, silence_timeout=0.05, max_backoff=0.05)
    subs.sync({"a:1"})
    for _ in range(100):
        if len(opened) >= 2:
            break
        await asyncio.sleep(0.02)
    await subs.close()
    assert len(opened) >= 2
