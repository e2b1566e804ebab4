"""The gateway's in-process ids are the tokenizer service's ids: the real service (SmolLM2)
against the gateway's Tokenizers for the exactness corpus, chats with control-token text,
counts and logprob texts."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from controlplane.schema import ModelSpec, ModelVersion
from controlplane.service_process import ServiceProcess
from controlplane.snapshot import ConfigSnapshot
from services.gateway.downstream import TokenizerClient
from services.gateway.tokenizers import Tokenizers
from services.gateway.validation import InferenceRequest, Message
from tests.unit.tokenization.corpus import CORPUS
from tests.unit.tokenization.test_exactness import CHATS
from tokenserve.models import DEFAULT_MODEL_NAME, default_model_path
from tokenserve.runtime.channels import aio_channel
from tokenserve.runtime.ports import free_port

MODEL = DEFAULT_MODEL_NAME


@pytest.fixture(scope="module")
def tokenizer_service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tokenizer")
    port = free_port()
    proc = ServiceProcess("services.tokenizer", [
        "--port", str(port), "--metrics-port", "-1",
        "--model", f"{MODEL}={default_model_path()}"], port, log_path=tmp / "tokenizer.log")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


async def test_local_ids_counts_and_texts_equal_the_tokenizer_services(tokenizer_service):
    channel = aio_channel(tokenizer_service.target)
    remote = TokenizerClient(channel)
    with ThreadPoolExecutor(2) as pool:
        local = Tokenizers(remote, pool)
        spec = ModelSpec(MODEL, {"v1": ModelVersion(f"builtin:{MODEL}", 2048)}, "v1")
        local.apply(ConfigSnapshot.from_documents(1, {spec.key: spec}))
        end = time.monotonic() + 30
        while local.local(MODEL) is None:
            assert time.monotonic() < end, "the gateway's tokenizer never loaded"
            time.sleep(0.01)
        # NUL never reaches a tokenizer from the gateway: validation refuses it first
        requests = [InferenceRequest(model=MODEL, max_tokens=1, prompt=t)
                    for t in CORPUS if t and "\x00" not in t]
        requests += [InferenceRequest(model=MODEL, max_tokens=1, messages=tuple(
            Message(m["role"], m["content"]) for m in chat)) for chat in CHATS
            if all(m["role"] in ("system", "user", "assistant") for m in chat)]
        for req in requests:
            want = await remote.encode(MODEL, req, 10)
            assert await local.encode(MODEL, req, 10) == want, req
            assert await local.count(MODEL, req, 10) == await remote.count(MODEL, req, 10)
        ids = sorted(set(await remote.encode(MODEL, requests[-1], 10)) | {0, 1, 2})
        assert await local.token_texts(MODEL, ids, 10) == await remote.token_texts(MODEL, ids, 10)
    await channel.close()
