"""Every bad input gets a precise status and a message that says what to fix."""
from __future__ import annotations

import grpc
import pytest

from tests.integration.tokenizer_service.conftest import MAX_TEXT_BYTES, MODEL
from tokenserve.common.v1 import common_pb2
from tokenserve.tokenizer.v1 import tokenizer_pb2 as pb

pytestmark = pytest.mark.slow  # starts a service process

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def status(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args)
    return err.value


def chat(*turns) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in turns])


def raw(channel, method: str, data: bytes):
    call = channel.unary_unary(f"/tokenserve.tokenizer.v1.TokenizerService/{method}")
    return call(data, timeout=10)


def test_unknown_model_lists_known_ones(stub):
    err = status(stub.Encode, pb.EncodeRequest(model="gpt-17", text="x"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "'gpt-17'" in err.details() and "smollm2" in err.details() and "tiny" in err.details()


def test_missing_model(stub):
    err = status(stub.GetTokenizerInfo, pb.GetTokenizerInfoRequest())
    assert err.code() == INVALID and "model is required" in err.details()


def test_broken_artifact_is_failed_precondition(stub):
    err = status(stub.Encode, pb.EncodeRequest(model="broken", text="x"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "broken.gguf" in err.details() and "GGUF" in err.details()


@pytest.mark.parametrize("method, request_bytes, field", [
    ("Encode", pb.EncodeRequest(model=MODEL, text="aXXc").SerializeToString(), "text"),
    ("CountTokens", pb.EncodeRequest(model=MODEL, chat=chat(("user", "ok"), ("user", "aXXc")))
     .SerializeToString(), "chat.messages[1].content"),
    ("EncodeBatch", pb.EncodeBatchRequest(model=MODEL, requests=[
        pb.EncodeRequest(text="fine"), pb.EncodeRequest(text="aXXc")]).SerializeToString(),
     "requests[1].text"),
])
def test_invalid_utf8_names_the_field(channel, method, request_bytes, field):
    bad = request_bytes.replace(b"XX", b"\xff\xfe")
    err = status(raw, channel, method, bad)
    assert err.code() == INVALID
    assert err.details().startswith(f"{field} is not valid UTF-8 (bad byte at offset 1")


def test_undecodable_bytes(channel):
    err = status(raw, channel, "Encode", b"\xff\xff\xff")
    assert err.code() == INVALID and "not a valid tokenserve.tokenizer.v1.EncodeRequest" in err.details()


def test_nul_character(stub):
    err = status(stub.Encode, pb.EncodeRequest(model=MODEL, text="ab\x00cd"))
    assert err.code() == INVALID and "text contains a NUL character at offset 2" in err.details()
    err = status(stub.Encode, pb.EncodeRequest(model=MODEL, chat=chat(("user", "\x00"))))
    assert "chat.messages[0].content contains a NUL" in err.details()


def test_oversize_text_gives_the_limit(stub):
    text = "é" * (MAX_TEXT_BYTES // 2 + 1)  # 2 bytes each: just over
    err = status(stub.Encode, pb.EncodeRequest(model=MODEL, text=text))
    assert err.code() == INVALID
    assert f"text is {MAX_TEXT_BYTES + 2} bytes of UTF-8; the limit is {MAX_TEXT_BYTES}" in err.details()
    assert ("max-text-bytes", str(MAX_TEXT_BYTES)) in err.trailing_metadata()
    # exactly at the limit is fine
    stub.CountTokens(pb.EncodeRequest(model=MODEL, text="é" * (MAX_TEXT_BYTES // 2)))


def test_oversize_chat_counts_all_strings(stub):
    half = "x" * (MAX_TEXT_BYTES // 2)
    err = status(stub.Encode, pb.EncodeRequest(model=MODEL, chat=chat(("user", half), ("user", half))))
    assert err.code() == INVALID and "chat is" in err.details()


def test_missing_input_and_empty_chat(stub):
    err = status(stub.Encode, pb.EncodeRequest(model=MODEL))
    assert err.code() == INVALID and "set text or chat" in err.details()
    err = status(stub.Encode, pb.EncodeRequest(model=MODEL, chat=pb.ChatMessages()))
    assert err.code() == INVALID and "chat.messages is empty" in err.details()


def test_template_error_names_the_message(stub):
    err = status(stub.Encode, pb.EncodeRequest(
        model="strict", chat=chat(("user", "a"), ("assistant", "b"), ("assistant", "c"))))
    assert err.code() == INVALID
    assert "at message 2" in err.details() and "roles must alternate" in err.details()
    err = status(stub.Encode, pb.EncodeRequest(model=MODEL, chat=chat(("user", "a"), ("", "b"))))
    assert err.code() == INVALID and "messages[1].role must be a non-empty string" in err.details()


def test_empty_and_oversize_batches(stub):
    for call in (stub.EncodeBatch, stub.CountTokensBatch):
        err = status(call, pb.EncodeBatchRequest(model=MODEL))
        assert err.code() == INVALID and "requests is empty" in err.details()
    err = status(stub.DecodeBatch, pb.DecodeBatchRequest(model=MODEL))
    assert err.code() == INVALID and "requests is empty" in err.details()
    err = status(stub.EncodeBatch, pb.EncodeBatchRequest(
        model=MODEL, requests=[pb.EncodeRequest(text="x")] * 9))
    assert err.code() == INVALID and "the limit is 8 per batch" in err.details()


def test_batch_item_for_another_model(stub):
    err = status(stub.EncodeBatch, pb.EncodeBatchRequest(
        model=MODEL, requests=[pb.EncodeRequest(text="x"), pb.EncodeRequest(model="tiny", text="y")]))
    assert err.code() == INVALID and "requests[1].model is 'tiny'" in err.details()


def test_batch_item_errors_name_the_item(stub):
    err = status(stub.EncodeBatch, pb.EncodeBatchRequest(
        model=MODEL, requests=[pb.EncodeRequest(text="x"), pb.EncodeRequest(text="\x00")]))
    assert "requests[1].text contains a NUL" in err.details()


def test_invalid_token_ids_give_the_vocabulary_size(stub):
    err = status(stub.Decode, pb.DecodeRequest(model=MODEL, token_ids=[5, 49152]))
    assert err.code() == INVALID
    assert "token_ids[1] = 49152 is not a token id: the vocabulary has 49152 tokens" in err.details()
    err = status(stub.DecodeBatch, pb.DecodeBatchRequest(model=MODEL, requests=[
        pb.DecodeRequest(token_ids=[1]), pb.DecodeRequest(token_ids=[-3])]))
    assert "requests[1].token_ids[0] = -3" in err.details()


def test_no_internal_after_bad_input(stub):
    # The service is still healthy and exact after all of the above.
    assert stub.CountTokens(pb.EncodeRequest(model=MODEL, text="still fine")).count > 0
