"""Queue bound and graceful shutdown of a real engine process."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tests.integration.engine_service.engine_process import NOT_SERVING, EngineProcess
from tokenserve.engine.v1 import engine_pb2 as pb
from tokenserve.engine.v1 import engine_pb2_grpc

pytestmark = pytest.mark.slow


async def test_full_queue_is_resource_exhausted_and_sigterm_drains_then_exits(tmp_path):
    proc = EngineProcess(tmp_path / "engine.log", "--max-waiting", "1", "--drain-seconds", "2",
                         "--grace-seconds", "10").start()
    try:
        await asyncio.to_thread(proc.wait_serving)
        async with grpc.aio.insecure_channel(proc.target) as ch:
            stub = engine_pb2_grpc.EngineServiceStub(ch)
            long = pb.GenerateRequest(prompt_token_ids=[500, 501], max_tokens=600, ignore_eos=True)
            running = [stub.Generate(long) for _ in range(16)]  # max concurrency 16
            for call in running:
                await call.read()
            queued = stub.Generate(long)
            for _ in range(600):
                if (await stub.GetInfo(pb.GetInfoRequest())).waiting == 1:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(long).read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "waiting" in e.value.details()
            assert int(dict(e.value.trailing_metadata())["retry-after-ms"]) > 0
            for call in [*running, queued]:
                call.cancel()
            # a short stream in flight at SIGTERM still completes
            short = stub.Generate(pb.GenerateRequest(prompt_token_ids=[7, 8], max_tokens=5,
                                                     ignore_eos=True))
            await short.read()
            proc.proc.send_signal(15)
            seen = set()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and NOT_SERVING not in seen:
                seen.add(await asyncio.to_thread(proc.health))
            assert NOT_SERVING in seen
            rest = [m async for m in short]
            assert rest[-1].usage.completion_tokens == 5
        code = await asyncio.to_thread(proc.proc.wait, 60)
        assert code == 0
    finally:
        proc.kill()
