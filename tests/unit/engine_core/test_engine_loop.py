"""The step thread + asyncio client: streaming, cancellation, a failing build."""
from __future__ import annotations

import asyncio
import threading

import pytest

from services.engine.block_manager import BlockManager
from services.engine import engine_loop
from services.engine.engine_core import EngineCore
from services.engine.engine_loop import AsyncEngine
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import FinishReason
from tests.unit.engine_core.fakes import EOS, FakeRunner, make_seq, reference_output


class ThreadCheckingRunner(FakeRunner):
    def __init__(self, *a):
        super().__init__(*a)
        self.threads: set[int] = set()

    def execute(self, batch):
        self.threads.add(threading.get_ident())
        return super().execute(batch)


def build(num_blocks=64):
    runner = ThreadCheckingRunner(num_blocks, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
                      BlockManager(num_blocks, 4), {EOS})
    return EngineCore(runner, sched)


async def started(builder=build) -> AsyncEngine:
    engine = AsyncEngine(builder)
    engine.start()
    await engine.wait_ready()
    return engine


async def collect(engine, seq):
    return [o async for o in engine.generate(seq)]


async def test_concurrent_streams_get_their_own_tokens_on_one_thread():
    engine = await started()
    try:
        seqs = [make_seq(engine.next_seq_id(), 3 + i, max_tokens=4 + i) for i in range(10)]
        results = await asyncio.gather(*(collect(engine, s) for s in seqs))
        for s, outs in zip(seqs, results):
            assert [t for o in outs for t in o.token_ids] == reference_output(s.prompt_token_ids,
                                                                               s.stop.max_tokens)
            assert outs[-1].finish_reason is FinishReason.LENGTH
        assert len(engine.loop.core.runner.threads) == 1
        assert engine.loop.core.runner.threads != {threading.get_ident()}
    finally:
        engine.stop()


async def test_leaving_a_stream_early_frees_its_blocks():
    engine = await started()
    try:
        seq = make_seq(engine.next_seq_id(), 20, max_tokens=10_000, ignore_eos=True)
        async for out in engine.generate(seq):
            if len(seq.output_token_ids) >= 3:
                break
        task = asyncio.create_task(collect(engine, make_seq(engine.next_seq_id(), 20,
                                                             max_tokens=10_000, ignore_eos=True)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # a short request afterwards runs on a clean engine
        await collect(engine, make_seq(engine.next_seq_id(), 4, max_tokens=2))
        for _ in range(200):
            if engine.loop.stats.blocks_free == 64 and engine.loop.stats.running == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.loop.stats.blocks_free == 64
    finally:
        engine.stop()


async def test_a_failing_build_is_reported_to_waiters():
    def broken():
        raise FileNotFoundError("no model here")
    engine = AsyncEngine(broken)
    engine.start()
    with pytest.raises(FileNotFoundError):
        await engine.wait_ready()
    assert not engine.is_ready


async def test_requests_sent_together_to_an_idle_engine_start_in_the_same_step(monkeypatch):
    """Submitted a millisecond apart (as a client's burst arrives), they are gathered before
    the first step instead of the first one running alone. (The quiet window is widened so a
    stall of this shared machine between two submits cannot split the burst.)"""
    monkeypatch.setattr(engine_loop, "GATHER_QUIET_S", 0.05)
    monkeypatch.setattr(engine_loop, "GATHER_MAX_S", 0.5)
    engine = await started()
    try:
        runner = engine.loop.core.runner
        seqs = [make_seq(engine.next_seq_id(), 5, max_tokens=2) for _ in range(4)]
        tasks = []
        for s in seqs:
            tasks.append(asyncio.create_task(collect(engine, s)))
            await asyncio.sleep(0.001)
        await asyncio.gather(*tasks)
        assert sorted(c.seq_id for c in runner.batches[0].chunks) == sorted(s.seq_id for s in seqs)
    finally:
        engine.stop()
