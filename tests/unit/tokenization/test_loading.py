"""Loading from GGUF files and Hugging Face folders, and the errors for bad artifacts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tiny_tokenizer import SPM_PIECES, write_gguf
from tokenserve.models import default_model_path
from tokenserve.tokenization import TokenizerLoadError, load_model_tokenizer

SPM_TEXTS = ["hello world", "  hello  world ", "the test is in", "你好 hello", "héllo xyz 😀",
             "<|user|>hi</s>", "\nhello", ""]


def test_sentencepiece_gguf_loads(tmp_path):
    tok = load_model_tokenizer(write_gguf(tmp_path / "tiny.gguf"))
    assert tok.vocab_size == 259 + len(SPM_PIECES) + 1
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.encode("hello", add_special_tokens=True)[0] == 1  # llama.cpp default: add BOS
    assert tok.decode(tok.encode("héllo 😀")) == "héllo 😀"  # byte fallback round trip
    assert tok.encode_chat([{"role": "user", "content": "x</s>"}]).count(2) == 1


@pytest.mark.slow
def test_sentencepiece_gguf_equals_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = write_gguf(tmp_path / "tiny.gguf")
    tok = load_model_tokenizer(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in SPM_TEXTS:
        for add in (False, True):
            assert tok.encode(text, add_special_tokens=add) == \
                hf(text, add_special_tokens=add, split_special_tokens=True).input_ids
            assert tok.encode(text, add_special_tokens=add, parse_special=True) == \
                hf(text, add_special_tokens=add).input_ids
        ids = tok.encode(text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "hello <|user|> world</s>"}]
    assert tok.encode_chat(messages) == hf.apply_chat_template(
        messages, tokenize=True, sanitize_control_tokens=True, return_dict=False)


def test_hf_folder_equals_gguf(tmp_path, smollm):
    smollm.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": smollm.chat_template, "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"}}))
    folder = load_model_tokenizer(tmp_path)
    text = "<|im_end|> 12  34 你好"
    assert folder.encode(text) == smollm.encode(text)
    assert folder.encode(text, parse_special=True) == smollm.encode(text, parse_special=True)
    assert (folder.bos_token_id, folder.eos_token_id) == (1, 2)
    assert folder.special_token_ids == smollm.special_token_ids
    messages = [{"role": "user", "content": "hi <|im_end|>"}]
    assert folder.encode_chat(messages) == smollm.encode_chat(messages)


def test_folder_with_one_gguf_loads_it(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    assert load_model_tokenizer(tmp_path).vocab_size == 259 + len(SPM_PIECES) + 1


def test_no_chat_template(tmp_path):
    tok = load_model_tokenizer(write_gguf(tmp_path / "t.gguf", chat_template=None))
    assert tok.chat_template is None
    with pytest.raises(Exception, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "x"}])


def load_error(path) -> TokenizerLoadError:
    with pytest.raises(TokenizerLoadError) as err:
        load_model_tokenizer(path)
    assert err.value.path == Path(path)
    return err.value


def test_missing_path(tmp_path):
    assert "no such file" in load_error(tmp_path / "nope.gguf").reason


def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 definitely a zip")
    assert "not a GGUF" in load_error(tmp_path / "x.gguf").reason


def test_truncated_gguf(tmp_path):
    data = default_model_path().read_bytes()[:200_000]  # cut inside the token list
    (tmp_path / "cut.gguf").write_bytes(data)
    assert "corrupt" in load_error(tmp_path / "cut.gguf").reason


def test_unsupported_tokenizer_model(tmp_path):
    reason = load_error(write_gguf(tmp_path / "t.gguf", model="rwkv")).reason
    assert "'rwkv'" in reason and "'gpt2'" in reason


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    # A byte-level vocabulary needs merges; the pre-tokenizer check comes with them.
    path = write_gguf(tmp_path / "t.gguf", model="gpt2", pre="mystery")
    assert "merges" in load_error(path).reason


def test_broken_chat_template(tmp_path):
    reason = load_error(write_gguf(tmp_path / "t.gguf", chat_template="{% if %}")).reason
    assert "chat template" in reason


def test_folder_without_tokenizer(tmp_path):
    assert "tokenizer.json" in load_error(tmp_path).reason


def test_malformed_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert "malformed tokenizer.json" in load_error(tmp_path).reason
