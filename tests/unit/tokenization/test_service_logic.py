"""The tokenizer service's pure parts: config validation, flags, wire-error descriptions."""
from __future__ import annotations


import pytest

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.main import parse_args
from tokenserve.runtime.wire import BadRequest, lenient
from tokenserve.common.v1 import common_pb2
from tokenserve.models import DEFAULT_MODEL_NAME, default_model_path
from tokenserve.tokenizer.v1 import tokenizer_pb2 as pb


def test_default_model_when_none_given():
    config = parse_args(["--port", "0"])
    assert config.models == {DEFAULT_MODEL_NAME: default_model_path()}
    assert config.max_text_bytes == 1024 * 1024


def test_model_flags_and_errors(tmp_path, capsys):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"")
    config = parse_args(["--model", f"a={f}", "--model", f"b={f}", "--max-text-bytes", "10"])
    assert config.models == {"a": f, "b": f} and config.max_text_bytes == 10
    for argv in (["--model", "nopath"], ["--model", f"a={f}", "--model", f"a={f}"],
                 ["--model", f"a={tmp_path / 'missing'}"], ["--max-text-bytes", "0"],
                 ["--model", f"bad name={f}"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    ({"models": {}}, "no models"),
    ({"workers": 0}, "workers"),
    ({"max_batch_items": 0}, "max_batch_items"),
    ({"port": 70000}, "port"),
])
def test_config_validation(kwargs, message):
    base = {"models": {"m": default_model_path()}}
    with pytest.raises(ValueError, match=message):
        TokenizerConfig(**{**base, **kwargs})


def test_lenient_passes_good_requests_through():
    req = pb.EncodeRequest(model="m", text="héllo")
    assert lenient(pb.EncodeRequest)(req.SerializeToString()) == req


def test_bad_utf8_in_nested_repeated_field_is_named():
    req = pb.EncodeBatchRequest(model="m", requests=[
        pb.EncodeRequest(text="a"),
        pb.EncodeRequest(chat=pb.ChatMessages(messages=[
            common_pb2.ChatMessage(role="user", content="ok"),
            common_pb2.ChatMessage(role="uZZ", content="x")]))])
    bad = req.SerializeToString().replace(b"ZZ", b"\xc3(")
    got = lenient(pb.EncodeBatchRequest)(bad)
    assert isinstance(got, BadRequest)
    assert got.reason.startswith("requests[1].chat.messages[1].role is not valid UTF-8 "
                                 "(bad byte at offset 1")


def test_garbage_gets_a_generic_reason():
    got = lenient(pb.DecodeRequest)(b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff")
    assert isinstance(got, BadRequest)
    assert got.reason == "the request is not a valid tokenserve.tokenizer.v1.DecodeRequest message"


async def test_registry_loads_once_reloads_on_new_path_and_does_not_cache_failures(tmp_path):
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from services.tokenizer.registry import TokenizerRegistry
    from tests.tiny_tokenizer import write_gguf
    from tokenserve.runtime.errors import InvalidArgument, NotFound
    from tokenserve.tokenization import TokenizerLoadError

    good = write_gguf(tmp_path / "a.gguf")
    other = write_gguf(tmp_path / "b.gguf", chat_template=None)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    with ThreadPoolExecutor(2) as pool:
        registry = TokenizerRegistry({"a": good, "bad": bad}, pool)
        first, second = await asyncio.gather(registry.get("a"), registry.get("a"))
        assert first is second and first.chat_template is not None
        registry.set_path("a", other)
        assert (await registry.get("a")).chat_template is None
        with pytest.raises(NotFound, match="unknown model 'zzz'; known models: a, bad"):
            await registry.get("zzz")
        with pytest.raises(InvalidArgument, match="model is required"):
            await registry.get("")
        with pytest.raises(TokenizerLoadError):
            await registry.get("bad")
        bad.write_bytes(good.read_bytes())  # fixed on disk: the next call loads it
        assert (await registry.get("bad")).vocab_size == first.vocab_size
        registry.remove("a")
        with pytest.raises(NotFound):
            await registry.get("a")
