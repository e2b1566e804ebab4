"""GrpcServer over real loopback gRPC: error mapping, health, reflection, graceful stop."""
import asyncio
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tokenserve.runtime import errors
from tokenserve.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tokenserve.runtime.server import EXIT_DEADLINE_STATUS, GrpcServer, Registration, ServerOptions

ROOT = Path(__file__).resolve().parents[3]

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name


class RaisingEngine(engine_pb2_grpc.EngineServiceServicer):
    """Raises whatever the request id names: pure test logic over the real runtime."""

    async def GetInfo(self, request, context):
        return engine_pb2.GetInfoResponse(model="m")

    async def Generate(self, request, context):
        yield engine_pb2.GenerateResponse(token_ids=[1], text="a")
        kind = request.request_id
        if kind == "invalid":
            raise errors.InvalidArgument("max_tokens must be >= 1, got 0")
        if kind == "exhausted":
            raise errors.ResourceExhausted("queue full (256 waiting)", retry_after=1.5)
        if kind == "bug":
            raise RuntimeError("secret prompt text")
        await asyncio.sleep(0.5)
        yield engine_pb2.GenerateResponse(token_ids=[2], text="b")


@pytest.fixture
async def server():
    srv = GrpcServer("test", [Registration(SERVICE, engine_pb2_grpc.add_EngineServiceServicer_to_server,
                                           RaisingEngine())],
                     ServerOptions(port=0, drain_seconds=0.3, grace_seconds=2))
    await srv.start()
    yield srv
    await srv.stop()


async def _collect(stub, request_id):
    got = []
    call = stub.Generate(engine_pb2.GenerateRequest(request_id=request_id))
    try:
        async for msg in call:
            got.append(msg.text)
    except grpc.aio.AioRpcError as e:
        return got, e
    return got, None


async def test_domain_errors_map_to_precise_status(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        got, err = await _collect(stub, "invalid")
        assert got == ["a"]
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens" in err.details()

        got, err = await _collect(stub, "exhausted")
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(err.trailing_metadata())["retry-after-ms"] == "1500"

        got, err = await _collect(stub, "bug")
        assert err.code() == grpc.StatusCode.INTERNAL
        assert "secret" not in err.details()

        got, err = await _collect(stub, "ok")
        assert got == ["a", "b"] and err is None


async def test_health_and_reflection(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = set()
        async for r in responses:
            names |= {s.name for s in r.list_services_response.service}
        assert SERVICE in names and "grpc.health.v1.Health" in names


async def test_stop_goes_not_serving_then_lets_inflight_finish(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        inflight = asyncio.create_task(_collect(stub, "slow"))
        await asyncio.sleep(0.1)
        stopping = asyncio.create_task(server.stop())
        await asyncio.sleep(0.1)
        health = health_pb2_grpc.HealthStub(ch)
        resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        got, err = await inflight
        assert got == ["a", "b"] and err is None
        await stopping


TOKENIZER = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name


class SyncTokenizer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """Plain-function handlers for the synchronous server mode (handler_threads)."""

    def GetTokenizerInfo(self, request, context):
        if request.model == "busy":
            raise errors.ResourceExhausted("queue full (256 waiting)", retry_after=1.5)
        if request.model == "bug":
            raise RuntimeError("secret prompt text")
        if request.model == "aborts":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "handler's own status")
        return tokenizer_pb2.GetTokenizerInfoResponse(model=request.model)


async def test_sync_handler_mode_maps_errors_and_serves_health_and_reflection():
    srv = GrpcServer("test", [Registration(TOKENIZER, tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server,
                                           SyncTokenizer())],
                     ServerOptions(port=0, drain_seconds=0, grace_seconds=1, handler_threads=2))
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(ch)
            info = tokenizer_pb2.GetTokenizerInfoRequest
            assert (await stub.GetTokenizerInfo(info(model="m"))).model == "m"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetTokenizerInfo(info(model="busy"))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue full" in e.value.details()
            assert dict(e.value.trailing_metadata())["retry-after-ms"] == "1500"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetTokenizerInfo(info(model="bug"))
            assert e.value.code() == grpc.StatusCode.INTERNAL and "secret" not in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetTokenizerInfo(info(model="aborts"))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            health = health_pb2_grpc.HealthStub(ch)
            resp = await health.Check(health_pb2.HealthCheckRequest(service=TOKENIZER))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            call = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            async for r in call:
                assert TOKENIZER in {s.name for s in r.list_services_response.service}
                break
    finally:
        await srv.stop()
    assert srv._server is None


def test_handler_threads_must_be_positive():
    with pytest.raises(ValueError, match="handler_threads"):
        ServerOptions(handler_threads=0)


def test_stop_bounds_must_be_positive():
    with pytest.raises(ValueError, match="stop_hook_seconds"):
        ServerOptions(stop_hook_seconds=0)
    with pytest.raises(ValueError, match="exit_deadline_seconds"):
        ServerOptions(exit_deadline_seconds=-1)


async def test_a_stop_hook_that_never_returns_is_left_behind_and_the_rest_run():
    ran = []

    async def stuck():
        await asyncio.Event().wait()

    async def after():
        ran.append("after")

    srv = GrpcServer("test", [], ServerOptions(port=0, drain_seconds=0, grace_seconds=0,
                                               stop_hook_seconds=0.3), on_stop=[stuck, after])
    await srv.start()
    await asyncio.wait_for(srv.stop(), 5)
    assert ran == ["after"] and srv._server is None


async def test_a_stop_asked_in_process_sets_no_exit_deadline():
    srv = GrpcServer("inproc", [], ServerOptions(port=0, drain_seconds=0, grace_seconds=0))
    await srv.start()
    running = asyncio.create_task(srv.run())
    await asyncio.sleep(0)
    srv.request_stop()
    await asyncio.wait_for(running, 5)
    # the process (here: pytest) goes on; nothing is left to end it later
    assert not [t for t in threading.enumerate() if t.name.startswith("exit-deadline")]


# A service whose stop leaves a thread that never ends: without the exit deadline the
# interpreter would wait for that thread forever after SIGTERM.
STUCK_SERVICE = """
import asyncio, threading
from tokenserve.runtime.server import GrpcServer, ServerOptions

def wedged_forever():
    threading.Event().wait()

async def leave_a_thread():
    threading.Thread(target=wedged_forever, name="wedged").start()

async def main():
    srv = GrpcServer("stuck", [], ServerOptions(port=0, drain_seconds=0, grace_seconds=0,
                                                exit_deadline_seconds=1.0),
                     on_stop=[leave_a_thread])
    await srv.start()
    # once run() has taken SIGTERM (it does before its first wait)
    asyncio.get_running_loop().call_soon(lambda: print("up", flush=True))
    await srv.run()

asyncio.run(main())
"""


def test_a_sigterm_ends_a_service_whose_stop_leaves_a_thread_behind():
    proc = subprocess.Popen([sys.executable, "-c", STUCK_SERVICE], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        while (line := proc.stdout.readline()) and line.strip() != "up":
            pass
        assert line, proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_DEADLINE_STATUS, err[-2000:]
    assert "exit_deadline_passed" in out + err
    assert "wedged_forever" in err, err[-2000:]  # every thread's stack: what it was stuck on
