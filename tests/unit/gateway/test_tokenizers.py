"""The gateway's in-process tokenizers: which requests they encode, and the fallback."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from controlplane.schema import ModelSpec, ModelVersion
from controlplane.snapshot import ConfigSnapshot
from services.gateway.tokenizers import INLINE_CHARS, Tokenizers
from services.gateway.validation import InferenceRequest, Message
from tokenserve.models import DEFAULT_MODEL_NAME, default_model_path
from tokenserve.tokenization import load_model_tokenizer

MODEL = DEFAULT_MODEL_NAME


class Remote:
    """The tokenizer service's client, as far as these tests need: records what reached it."""

    def __init__(self):
        self.calls = []

    async def encode(self, model, req, timeout):
        self.calls.append(("encode", model))
        return [7, 7, 7]

    async def count(self, model, req, timeout):
        self.calls.append(("count", model))
        return 3

    async def token_texts(self, model, ids, timeout):
        self.calls.append(("token_texts", model))
        return {i: "?" for i in ids}


def snapshot(artifact: str, revision: int = 1) -> ConfigSnapshot:
    spec = ModelSpec(MODEL, {"v1": ModelVersion(artifact, 2048)}, "v1")
    return ConfigSnapshot.from_documents(revision, {spec.key: spec})


def loaded(tokenizers: Tokenizers, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while tokenizers.local(MODEL) is None:
        assert time.monotonic() < end, "the local tokenizer never loaded"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference():
    return load_model_tokenizer(default_model_path())


@pytest.fixture
def pool():
    with ThreadPoolExecutor(2) as p:
        yield p


async def test_a_readable_artifact_is_encoded_here_with_the_services_ids(reference, pool):
    remote = Remote()
    tok = Tokenizers(remote, pool)
    tok.apply(snapshot(f"builtin:{MODEL}"))
    loaded(tok)
    text = "Hello <|im_start|> wörld, 12345 🙂"
    req = InferenceRequest(model=MODEL, max_tokens=4, prompt=text)
    assert await tok.encode(MODEL, req, 5) == reference.encode(text, add_special_tokens=True)
    chat = (Message("system", "Be brief."), Message("user", "Say <|im_end|> hi"))
    creq = InferenceRequest(model=MODEL, max_tokens=4, messages=chat)
    want = reference.encode_chat([{"role": m.role, "content": m.content} for m in chat],
                                 add_generation_prompt=True)
    assert await tok.encode(MODEL, creq, 5) == want
    assert await tok.count(MODEL, creq, 5) == len(want)
    long = "word " * (INLINE_CHARS // 4)  # encoded on a worker thread
    lreq = InferenceRequest(model=MODEL, max_tokens=4, prompt=long)
    assert await tok.encode(MODEL, lreq, 5) == reference.encode(long, add_special_tokens=True)
    texts = await tok.token_texts(MODEL, [1, 2, 28120], 5)
    assert texts == {i: reference.decode([i], skip_special_tokens=False) for i in (1, 2, 28120)}
    assert remote.calls == []


async def test_what_this_host_cannot_read_goes_to_the_tokenizer_service(pool, tmp_path):
    remote = Remote()
    tok = Tokenizers(remote, pool)
    tok.apply(snapshot(str(tmp_path / "missing.gguf")))
    req = InferenceRequest(model=MODEL, max_tokens=4, prompt="hi")
    assert await tok.encode(MODEL, req, 5) == [7, 7, 7]
    assert await tok.encode("other-model", req, 5) == [7, 7, 7]  # not in the config
    tok.apply(snapshot("builtin:no-such-wheel"))
    assert await tok.count(MODEL, req, 5) == 3
    assert remote.calls == [("encode", MODEL), ("encode", "other-model"), ("count", MODEL)]


async def test_a_broken_artifact_falls_back_and_remote_mode_never_loads(pool, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    remote = Remote()
    tok = Tokenizers(remote, pool)
    tok.apply(snapshot(str(broken)))
    pool.submit(lambda: None).result()  # the load ran (and failed) on the pool
    time.sleep(0.1)
    req = InferenceRequest(model=MODEL, max_tokens=4, prompt="hi")
    assert tok.local(MODEL) is None and await tok.encode(MODEL, req, 5) == [7, 7, 7]
    off = Tokenizers(remote, pool, local=False)
    off.apply(snapshot(f"builtin:{MODEL}"))
    time.sleep(0.2)
    assert off.local(MODEL) is None and await off.encode(MODEL, req, 5) == [7, 7, 7]


async def test_a_changed_artifact_drops_the_old_tokenizer(pool, tmp_path):
    tok = Tokenizers(Remote(), pool)
    tok.apply(snapshot(f"builtin:{MODEL}"))
    loaded(tok)
    tok.apply(snapshot(str(tmp_path / "moved.gguf"), revision=2))  # unreadable here
    assert tok.local(MODEL) is None
    copy = tmp_path / "copy.gguf"
    copy.symlink_to(default_model_path())
    tok.apply(snapshot(str(copy), revision=3))
    loaded(tok)
