"""Models listed in etcd are served without a restart (`--etcd-endpoints`)."""
from __future__ import annotations

import time

import grpc
import pytest

from controlplane.schema import ModelSpec, ModelVersion
from controlplane.service_process import ServiceProcess
from controlplane.store import ConfigStore
from tokenserve.runtime.ports import free_port
from tests.etcd_fixture import etcd  # noqa: F401  (pytest fixture)
from tests.tiny_tokenizer import write_gguf
from tokenserve.tokenizer.v1 import tokenizer_pb2 as pb
from tokenserve.tokenizer.v1 import tokenizer_pb2_grpc

pytestmark = pytest.mark.slow  # starts etcd and a service process


def spec(name: str, artifact: str) -> ModelSpec:
    return ModelSpec(name, {"v1": ModelVersion(artifact, 2048)}, "v1")


def wait_for(check, timeout: float = 15.0):
    # The service has no change feed to subscribe to; poll its answers until the deadline.
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except (grpc.RpcError, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


async def test_models_follow_etcd(etcd, tmp_path):  # noqa: F811
    tiny = write_gguf(tmp_path / "tiny.gguf")
    async with ConfigStore([etcd.endpoint]) as store:
        await store.put(spec("smollm2-135m-instruct", "builtin:smollm2-135m-instruct"), actor="test")
    port = free_port()
    proc = ServiceProcess("services.tokenizer", [
        "--port", str(port), "--metrics-port", "-1", "--etcd-endpoints", etcd.endpoint,
        "--config-snapshot", str(tmp_path / "snap.json")], port, log_path=tmp_path / "tok.log")
    proc.start()
    try:
        with grpc.insecure_channel(proc.target) as ch:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(ch)
            info = stub.GetTokenizerInfo(pb.GetTokenizerInfoRequest(model="smollm2-135m-instruct"))
            assert info.vocab_size == 49152
            with pytest.raises(grpc.RpcError) as err:
                stub.GetTokenizerInfo(pb.GetTokenizerInfoRequest(model="tiny"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

            async with ConfigStore([etcd.endpoint]) as store:
                await store.put(spec("tiny", str(tiny)), actor="test")
            info = wait_for(lambda: stub.GetTokenizerInfo(pb.GetTokenizerInfoRequest(model="tiny")))
            assert info.bos_token_id == 1 and info.vocab_size < 1000

            async with ConfigStore([etcd.endpoint]) as store:
                await store.delete("models/tiny", actor="test")

            def gone() -> grpc.StatusCode:
                try:
                    stub.GetTokenizerInfo(pb.GetTokenizerInfoRequest(model="tiny"))
                except grpc.RpcError as e:
                    return e.code()
                raise AssertionError("tiny is still served")
            assert wait_for(gone) == grpc.StatusCode.NOT_FOUND
    finally:
        proc.stop()
