"""Queue bound, etcd registration and graceful shutdown of a real engine process."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from aetcd import rpc

from controlplane.service_process import NOT_SERVING
from tests.integration.engine_service.conftest import engine_process
from tokenserve.engine.v1 import engine_pb2 as pb
from tokenserve.engine.v1 import engine_pb2_grpc

pytestmark = pytest.mark.slow

ENGINES = b"/tokenserve/v1/engines/"


def registered(endpoint: str) -> list[bytes]:
    with grpc.insecure_channel(endpoint) as ch:
        resp = rpc.KVStub(ch).Range(rpc.RangeRequest(key=ENGINES, range_end=ENGINES[:-1] + b"0"),
                                    timeout=5)
    return [kv.value for kv in resp.kvs]


async def test_full_queue_is_resource_exhausted_and_sigterm_drains_then_exits(tmp_path, etcd):
    proc = engine_process(tmp_path / "engine.log", "--max-waiting", "1", "--drain-seconds", "2",
                          "--grace-seconds", "10", "--etcd-endpoints", etcd.endpoint).spawn()
    try:
        await asyncio.to_thread(proc.wait_serving, 600)
        for _ in range(100):  # registration follows SERVING
            if regs := registered(etcd.endpoint):
                break
            await asyncio.sleep(0.1)
        assert len(regs) == 1 and f"127.0.0.1:{proc.port}".encode() in regs[0]
        # The engine registers the context of the model it really loaded.
        async with grpc.aio.insecure_channel(proc.target) as ch:
            info = await engine_pb2_grpc.EngineServiceStub(ch).GetInfo(pb.GetInfoRequest())
        assert info.max_context > 0
        assert json.loads(regs[0])["max_context"] == info.max_context
        # What the model load left alive is out of the collector's walks for good (a full
        # collection over it stalled a step by ~33 ms).
        ready = [json.loads(line) for line in (tmp_path / "engine.log").read_text().splitlines()
                 if '"engine_ready"' in line]
        assert len(ready) == 1 and ready[0]["gc_frozen_objects"] > 50_000, ready
        async with grpc.aio.insecure_channel(proc.target) as ch:
            stub = engine_pb2_grpc.EngineServiceStub(ch)
            watch = stub.WatchLoad(pb.WatchLoadRequest())
            idle = await watch.read()
            assert (idle.model, idle.running, idle.waiting, idle.kv_blocks_used) == (
                "smollm2-135m-instruct", 0, 0, 0)
            assert idle.kv_blocks_total == info.kv_blocks_total and idle.max_concurrency == 16
            long = pb.GenerateRequest(prompt_token_ids=[500, 501], max_tokens=600, ignore_eos=True)
            running = [stub.Generate(long) for _ in range(16)]  # max concurrency 16
            for call in running:
                await call.read()
            queued = stub.Generate(long)
            for _ in range(600):
                if (await stub.GetInfo(pb.GetInfoRequest())).waiting == 1:
                    break
                await asyncio.sleep(0.05)
            # the load stream reports the same, within a report or two of the change
            t0 = time.monotonic()
            while (load := await watch.read()).waiting != 1 or load.running != 16:
                assert time.monotonic() - t0 < 3
            assert load.kv_blocks_used > 0 and load.ttft_p99_seconds > 0
            assert load.tokens_per_second > 0 and load.watts > 0
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(long).read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "waiting limit" in e.value.details()
            trailing = dict(e.value.trailing_metadata())
            assert int(trailing["retry-after-ms"]) > 0 and trailing["limit"] == "capacity"
            for call in [*running, queued]:
                call.cancel()
            # a short stream in flight at SIGTERM still completes
            short = stub.Generate(pb.GenerateRequest(prompt_token_ids=[7, 8], max_tokens=5,
                                                     ignore_eos=True))
            first = await short.read()
            proc.proc.send_signal(15)
            seen = set()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and NOT_SERVING not in seen:
                seen.add(await asyncio.to_thread(proc.health))
            assert NOT_SERVING in seen
            ends = time.monotonic()  # draining ends the load stream at once
            while await watch.read() is not grpc.aio.EOF:
                assert time.monotonic() - ends < 1.5
            last = first
            while (m := await short.read()) is not grpc.aio.EOF:
                last = m
            assert last.usage.completion_tokens == 5
        code = await asyncio.to_thread(proc.proc.wait, 60)
        assert code == 0
        assert registered(etcd.endpoint) == []  # lease revoked on the way out
    finally:
        proc.kill()
