"""A request the engine ends at its deadline ends DEADLINE_EXCEEDED, not OK.

The engine aborts a request whose deadline passed at the next step boundary; gRPC's own
timer usually ends the call first, but on a busy machine the engine's final message can
win the race. The caller must then still see DEADLINE_EXCEEDED, never an OK stream that
reads as finished. Here the context has a deadline and no timer of its own (the engine's
side of the race, made certain)."""
from __future__ import annotations

import time

import pytest

from services.engine.block_manager import BlockManager
from services.engine.engine_core import EngineCore
from services.engine.engine_loop import AsyncEngine
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.servicer import EngineServicer, ModelInfo
from tests.unit.engine_core.fakes import EOS, FakeRunner
from tokenserve.common.v1 import common_pb2
from tokenserve.engine.v1 import engine_pb2 as pb
from tokenserve.runtime.errors import DeadlineExceeded


class SlowRunner(FakeRunner):
    def execute(self, batch):
        time.sleep(0.02)
        return super().execute(batch)


class DeadlineOnly:
    """A servicer context with `seconds` left and no timer: only the engine enforces it."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def time_remaining(self) -> float:
        return self.seconds


def build():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
                      BlockManager(256, 4), {EOS})
    return EngineCore(SlowRunner(256, 4), sched)


async def serving(engine: AsyncEngine) -> EngineServicer:
    engine.start()
    await engine.wait_ready()
    servicer = EngineServicer(engine)
    servicer.info = ModelInfo(model="fake", version="v1", max_context=1024, vocab_size=1000,
                              eos_token_ids=frozenset({EOS}), device="cpu", dtype="float32",
                              block_size=4, num_blocks=256, max_concurrency=4, max_waiting=8)
    return servicer


async def test_a_request_the_engine_ends_at_its_deadline_ends_deadline_exceeded():
    engine = AsyncEngine(build)
    servicer = await serving(engine)
    try:
        request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=500, ignore_eos=True)
        messages = []
        with pytest.raises(DeadlineExceeded) as e:
            async for m in servicer.Generate(request, DeadlineOnly(0.3)):
                messages.append(m)
        streamed = sum(len(m.token_ids) for m in messages)
        assert 0 < streamed < 500
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_CANCELLED
        assert f"after {streamed} of 500 tokens" in e.value.message
        # its blocks are free again
        assert engine.loop.core.scheduler.blocks.num_free_blocks == 256
    finally:
        engine.stop()


async def test_a_request_that_finishes_before_its_deadline_ends_ok():
    engine = AsyncEngine(build)
    servicer = await serving(engine)
    try:
        request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True)
        messages = [m async for m in servicer.Generate(request, DeadlineOnly(30.0))]
        assert sum(len(m.token_ids) for m in messages) == 3
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    finally:
        engine.stop()
