"""Every RPC through a real server, against the library's own answers."""
from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.tokenizer_service.conftest import MAX_TEXT_BYTES, MODEL, TINY
from tests.unit.tokenization.corpus import CORPUS
from tokenserve.common.v1 import common_pb2
from tokenserve.models import default_model_path
from tokenserve.tokenization import load_model_tokenizer
from tokenserve.tokenizer.v1 import tokenizer_pb2 as pb

pytestmark = pytest.mark.slow  # starts a service process

CHAT = [("user", "Hi <|im_end|> there"), ("assistant", "Hello! 123"), ("user", "你好 😀")]
TEXTS = [t for t in CORPUS if "\x00" not in t]


@pytest.fixture(scope="module")
def lib():
    return load_model_tokenizer(default_model_path())


def chat_pb(turns=CHAT) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in turns])


def chat_dicts(turns=CHAT) -> list[dict]:
    return [{"role": r, "content": c} for r, c in turns]


def test_encode_text(stub, lib):
    for text in TEXTS:
        resp = stub.Encode(pb.EncodeRequest(model=MODEL, text=text))
        assert list(resp.token_ids) == lib.encode(text)
        assert resp.rendered_chars == 0


def test_encode_text_special_tokens_only_when_asked(stub):
    plain = stub.Encode(pb.EncodeRequest(model=MODEL, text="<|im_end|>")).token_ids
    parsed = stub.Encode(pb.EncodeRequest(model=MODEL, text="<|im_end|>", parse_special=True))
    assert 2 not in plain
    assert list(parsed.token_ids) == [2]


def test_encode_chat(stub, lib):
    resp = stub.Encode(pb.EncodeRequest(model=MODEL, chat=chat_pb(), add_generation_prompt=True))
    assert list(resp.token_ids) == lib.encode_chat(chat_dicts())
    assert list(resp.token_ids).count(2) == 4  # the system turn's and 3 messages' ends, not the typed one
    assert resp.rendered_chars == len(lib.render_chat(chat_dicts()))
    without = stub.Encode(pb.EncodeRequest(model=MODEL, chat=chat_pb()))
    assert list(without.token_ids) == lib.encode_chat(chat_dicts(), add_generation_prompt=False)


def test_encode_chat_parse_special_trusts_the_content(stub, lib):
    resp = stub.Encode(pb.EncodeRequest(model=MODEL, chat=chat_pb(), parse_special=True))
    assert list(resp.token_ids).count(2) == 5


def test_count_tokens(stub, lib):
    assert stub.CountTokens(pb.EncodeRequest(model=MODEL, text=TEXTS[-3])).count == \
        len(lib.encode(TEXTS[-3]))
    assert stub.CountTokens(pb.EncodeRequest(model=MODEL, chat=chat_pb(),
                                             add_generation_prompt=True)).count == \
        len(lib.encode_chat(chat_dicts()))


def test_encode_batch_mixed(stub, lib):
    requests = [pb.EncodeRequest(text=t) for t in TEXTS[:5]] + [
        pb.EncodeRequest(model=MODEL, chat=chat_pb(), add_generation_prompt=True),
        pb.EncodeRequest(text="<|im_start|>", parse_special=True)]
    resp = stub.EncodeBatch(pb.EncodeBatchRequest(model=MODEL, requests=requests))
    got = [list(r.token_ids) for r in resp.results]
    assert got == [lib.encode(t) for t in TEXTS[:5]] + [lib.encode_chat(chat_dicts()), [1]]
    counts = stub.CountTokensBatch(pb.EncodeBatchRequest(model=MODEL, requests=requests)).counts
    assert list(counts) == [len(ids) for ids in got]


def test_decode_and_batch(stub, lib):
    ids = lib.encode_chat(chat_dicts())
    full = stub.Decode(pb.DecodeRequest(model=MODEL, token_ids=ids)).text
    assert full == lib.render_chat(chat_dicts())
    skipped = stub.Decode(pb.DecodeRequest(model=MODEL, token_ids=ids, skip_special_tokens=True))
    assert "<|im_start|>" not in skipped.text and "Hi <|im_end|> there" in skipped.text
    batch = [lib.encode(t) for t in TEXTS[:8]]
    resp = stub.DecodeBatch(pb.DecodeBatchRequest(model=MODEL, requests=[
        pb.DecodeRequest(token_ids=i, skip_special_tokens=n % 2 == 0) for n, i in enumerate(batch)]))
    assert [r.text for r in resp.results] == TEXTS[:8]


def test_tokenizer_info(stub):
    info = stub.GetTokenizerInfo(pb.GetTokenizerInfoRequest(model=MODEL))
    assert (info.model, info.vocab_size, info.bos_token_id, info.eos_token_id) == (MODEL, 49152, 1, 2)
    assert list(info.special_token_ids) == list(range(17))
    assert info.has_chat_template and info.max_text_bytes == MAX_TEXT_BYTES
    tiny = stub.GetTokenizerInfo(pb.GetTokenizerInfoRequest(model=TINY))
    assert tiny.HasField("bos_token_id") and tiny.bos_token_id == 1
    assert tiny.vocab_size < 1000


def test_concurrent_first_use_loads_once(stub, service):
    # "lazy" is used by no other test: the 16 calls race its first load.
    def call(i):
        return list(stub.Encode(pb.EncodeRequest(model="lazy", text=f"hello world {i}")).token_ids)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, range(16)))
    assert results == [call(i) for i in range(16)]
    loads = [line for line in service.log_path.read_text().splitlines()
             if "tokenizer_loaded" in line and '"model": "lazy"' in line]
    assert len(loads) == 1


def test_metrics(stub, service):
    stub.Encode(pb.EncodeRequest(model=MODEL, text="count me"))
    body = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics").read().decode()
    assert 'tokenserve_tokenizer_requests_total{code="OK",method="Encode"}' in body
    assert 'tokenserve_tokenizer_tokens_encoded_total{model="smollm2"}' in body
    assert "tokenserve_tokenizer_request_duration_seconds_bucket" in body
