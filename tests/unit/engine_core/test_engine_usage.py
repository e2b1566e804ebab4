"""The engine's own usage record: one per request, finished or cancelled, spooled on a real
SQLite file with the counts the engine computed."""
from __future__ import annotations

import asyncio
import dataclasses

from services.engine.block_manager import BlockManager
from services.engine.engine_core import EngineCore
from services.engine.engine_loop import AsyncEngine
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.usage import EngineUsage
from tests.unit.engine_core.fakes import EOS, FakeRunner, make_seq
from tokenserve.spool import UsageSpool
from tokenserve.usage import Source


def build():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
                      BlockManager(64, 4), {EOS})
    return EngineCore(FakeRunner(64, 4), sched)


async def test_finished_and_cancelled_requests_each_leave_one_record(tmp_path):
    spool = UsageSpool(tmp_path / "engine-spool.db")
    usage = EngineUsage("m", "v1", spool, clock=lambda: 1_700_000_000.0)
    engine = AsyncEngine(build, on_final=usage.record)
    engine.start()
    await engine.wait_ready()
    try:
        done = dataclasses.replace(make_seq(engine.next_seq_id(), 5, max_tokens=4,
                                            tenant="acme"), request_id="done")
        outs = [o async for o in engine.generate(done)]
        assert sum(len(o.token_ids) for o in outs) == 4

        cut = dataclasses.replace(make_seq(engine.next_seq_id(), 6, max_tokens=10_000,
                                           ignore_eos=True, tenant="acme"), request_id="cut")
        async for _ in engine.generate(cut):
            if len(cut.output_token_ids) >= 3:
                break
        anonymous = make_seq(engine.next_seq_id(), 3, max_tokens=2, tenant="")  # not billed
        _ = [o async for o in engine.generate(anonymous)]
        for _ in range(500):  # the abort's final output reaches the loop a step later
            if len(spool) == 2:
                break
            await asyncio.sleep(0.01)
    finally:
        engine.stop()
    records = {r.request_id: r for _, r in spool.oldest(10)}
    assert set(records) == {"done", "cut"}
    d, c = records["done"], records["cut"]
    assert (d.source, d.tenant_id, d.model, d.model_version) == (Source.ENGINE, "acme", "m", "v1")
    assert (d.prompt_tokens, d.completion_tokens, d.finish_reason, d.cancelled) == (
        5, 4, "length", False)
    assert (c.prompt_tokens, c.finish_reason, c.cancelled, c.status) == (
        6, "cancelled", True, "CANCELLED")
    assert c.completion_tokens >= 3
    assert d.finished_at == 1_700_000_000.0 and d.started_at <= d.finished_at
    spool.close()


async def test_a_request_still_running_when_the_engine_stops_is_recorded_as_cancelled(tmp_path):
    """SIGTERM: the grace period ends, the server cuts the stream and the step thread stops
    before it takes the abort; the request is recorded all the same."""
    spool = UsageSpool(tmp_path / "engine-spool.db")
    usage = EngineUsage("m", "v1", spool)
    engine = AsyncEngine(build, on_final=usage.record)
    engine.start()
    await engine.wait_ready()
    seq = dataclasses.replace(make_seq(engine.next_seq_id(), 4, max_tokens=10_000,
                                       ignore_eos=True, tenant="acme"), request_id="at-stop")
    stream = engine.generate(seq)
    await anext(stream)
    await asyncio.to_thread(engine.stop)  # still running: no abort was sent
    await asyncio.sleep(0)  # the step thread's last outputs reach the event loop
    await stream.aclose()
    records = [r for _, r in spool.oldest(10)]
    assert [(r.request_id, r.finish_reason, r.cancelled) for r in records] == [
        ("at-stop", "cancelled", True)]
    assert records[0].completion_tokens >= 1
    spool.close()
