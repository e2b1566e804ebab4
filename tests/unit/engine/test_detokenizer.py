"""Incremental detokenization: deltas concatenate to the one-shot decode, never a broken char."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.engine.detokenizer import IncrementalDetokenizer
from tokenserve.models import default_model_path
from tokenserve.tokenization import load_model_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "中文测试：你好，世界。日本語もテストします。",
    "emoji 🎉🚀👩‍👩‍👧‍👦 mixed with text 🇺🇸 flags",
    "  leading spaces\n\nnewlines\ttabs   and trailing  ",
    "Ünïcödé àccents ßtraße — “quotes” … 1234567890",
    "code: def f(x):\n    return x ** 2  # ✓",
]


@pytest.fixture(scope="module")
def smollm_tok():
    return load_model_tokenizer(default_model_path())


def byte_fallback_tokenizer() -> Tokenizer:
    """A SentencePiece-style BPE (Llama-2 decoder chain) where every CJK char or emoji falls
    back to <0xNN> byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "c", "h", "i", "e", "l", "o", "▁h", "▁hi", "ll", "▁hello", "!"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("▁h", "i"), ("l", "l")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_smollm_deltas_concatenate_to_full_decode(smollm_tok, text):
    ids = smollm_tok.encode(text)
    deltas = stream(IncrementalDetokenizer(smollm_tok), ids)
    assert "".join(deltas) == smollm_tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_characters_are_held_until_complete(smollm_tok):
    ids = smollm_tok.encode("🎉")
    assert len(ids) > 1  # the emoji is split across byte-level tokens
    detok = IncrementalDetokenizer(smollm_tok)
    deltas = [detok.push(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🎉"


@pytest.mark.parametrize("text", ["hi hello 你好!", "🎉 hi", "hello 🚀🚀 ll 中", "a b c"])
def test_byte_fallback_tokens(text):
    tok = byte_fallback_tokenizer()
    ids = tok.encode(text, add_special_tokens=False).ids
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids) or text == "a b c"
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_like_decode(smollm_tok):
    ids = smollm_tok.encode("<|im_start|>assistant\nHi there<|im_end|>", parse_special=True)
    assert any(i in smollm_tok.special_token_ids for i in ids)
    for skip in (True, False):
        detok = IncrementalDetokenizer(smollm_tok, skip_special_tokens=skip)
        assert "".join(stream(detok, ids)) == smollm_tok.decode(ids, skip_special_tokens=skip)


def test_invalid_bytes_at_the_end_are_flushed_as_replacement():
    tok = byte_fallback_tokenizer()
    lead_byte = tok.token_to_id("<0xE4>")  # first byte of a 3-byte char, never completed
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.token_to_id("▁hi")) == "hi"
    assert detok.push(lead_byte) == ""
    assert detok.flush() == tok.decode([tok.token_to_id("▁hi"), lead_byte])[2:]
    assert detok.text.startswith("hi") and detok.text.endswith("\ufffd")


def test_context_ids_give_the_first_token_its_leading_space():
    tok = byte_fallback_tokenizer()
    prompt = tok.encode("hi", add_special_tokens=False).ids
    out = tok.encode("hi hello", add_special_tokens=False).ids[1:]  # "▁hello"
    detok = IncrementalDetokenizer(tok, context_ids=prompt)
    assert "".join(stream(detok, out)) == " hello"
    assert detok.token_ids == out


@pytest.mark.parametrize("text", TEXTS)
def test_with_prompt_context_deltas_extend_the_prompt_text(smollm_tok, text):
    """As the engine core uses it: the prompt's last tokens as context, never emitted."""
    context = smollm_tok.encode_chat([{"role": "user", "content": "Say something."}])[-5:]
    out = smollm_tok.encode(text)
    deltas = stream(IncrementalDetokenizer(smollm_tok, context_ids=context), out)
    full = smollm_tok.decode(context + out)
    assert "".join(deltas) == full[len(smollm_tok.decode(context)):]
    assert not any("\ufffd" in d for d in deltas)
