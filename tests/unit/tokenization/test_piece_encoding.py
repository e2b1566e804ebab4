"""Long texts encoded in pieces on several cores get exactly the ids of the whole text."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer

from tests.unit.tokenization.corpus import CODE, CORPUS
from tokenserve.piece_encoding import PieceEncoder, split_text, splittable
from tokenserve.tokenization import ModelTokenizer


def every_cut(text: str) -> list[str]:
    # one piece per cut place: split_text's targets fall on every character
    return split_text(text, len(text), min_chars=1)


@pytest.mark.parametrize("index", range(len(CORPUS)))
def test_every_cut_place_keeps_the_ids(smollm, index):
    text = CORPUS[index]
    pieces = every_cut(text)
    assert "".join(pieces) == text
    for tok in (smollm.backend, smollm._parsing):  # user text, and parse_special=True
        whole = tok.encode(text).ids
        for i in range(1, len(pieces)):  # the text cut in two at each place
            left, right = "".join(pieces[:i]), "".join(pieces[i:])
            assert tok.encode(left).ids + tok.encode(right).ids == whole, (left[-20:], right[:20])


def test_cut_places_are_word_then_ascii_space():
    text = "ab cd\u3000ef\u200b gh\tij\u00a0\nkl \u2028mn"
    pieces = every_cut(text)
    cuts = [len("".join(pieces[:i])) for i in range(1, len(pieces))]
    # after b, d? no (ideographic space), after the zero-width space? no (not printable), h, j? no
    assert [text[c - 1:c + 1] for c in cuts] == ["b ", "h\t", "l "]


def test_short_and_spaceless_texts_stay_whole():
    assert split_text("word " * 70, 4) == ["word " * 70]  # 350 characters: < 2 x 192
    assert split_text("你好" * 500, 4) == ["你好" * 500]     # no place to cut
    pieces = split_text(CODE * 3, 4)
    assert len(pieces) == 4 and "".join(pieces) == CODE * 3


def test_long_texts_through_the_model_tokenizer(smollm):
    texts = [t for t in CORPUS if len(t) >= 2 * 192] + [CODE * 20]
    assert smollm._encoder.max_pieces > 1  # SmolLM2's tokenizer is cut (on a machine with 2+ cores)
    for text in texts:
        assert smollm.encode(text) == smollm.backend.encode(text).ids
        assert smollm.encode(text, parse_special=True) == smollm._parsing.encode(text).ids


def test_concurrent_callers_get_their_own_ids(smollm):
    # More callers than helper threads: pieces are claimed by whoever is free, never lost or mixed.
    texts = [CODE * (1 + i % 7) + f"# caller {i}\n" for i in range(64)]
    expected = [smollm.backend.encode(t).ids for t in texts]
    encoder = PieceEncoder(smollm.backend, threads=4)
    with ThreadPoolExecutor(8) as callers:
        got = list(callers.map(lambda t: encoder.encode(smollm.backend, t), texts))
    assert got == expected


def _variant(smollm, change) -> Tokenizer:
    spec = json.loads(smollm.backend.to_str())
    change(spec)
    return Tokenizer.from_str(json.dumps(spec))


def _set_prefix_space(spec):
    spec["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = True


def _llama3_split(spec):
    # Llama 3's regex keeps punctuation with the newlines after it; a vocabulary trained with it
    # has tokens such as ";\n" (added here: SmolLM2's has none).
    spec["model"]["vocab"][";Ċ"] = len(spec["model"]["vocab"])
    spec["model"]["merges"].insert(0, [";", "Ċ"])
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "behavior": "Isolated", "invert": False, "pattern": {"Regex": (
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
            r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")}},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


def _rstrip_token(spec):
    spec["added_tokens"].append({"id": 49152, "content": "<tool>", "single_word": False,
                                 "lstrip": False, "rstrip": True, "normalized": False,
                                 "special": False})


def _lowercase(spec):
    spec["normalizer"] = {"type": "Lowercase"}


@pytest.mark.parametrize("change, text", [
    (_set_prefix_space, "every piece\nwould get a space\n" * 20),
    (_llama3_split, "x = f(a);\nreturn x;\n" * 30),   # ";\n" is one pre-token there
    (_rstrip_token, "call <tool>   now " * 30),       # the token eats the spaces after it
])
def test_tokenizers_that_cutting_would_change_are_encoded_whole(smollm, change, text):
    tok = _variant(smollm, change)
    assert not splittable(tok)
    whole = tok.encode(text).ids
    # cutting would change these ids...
    assert [i for p in every_cut(text) for i in tok.encode(p).ids] != whole
    # ...so the model tokenizer does not cut
    model_tok = ModelTokenizer(tok, bos_token_id=None, eos_token_id=None,
                               special_token_ids=frozenset(), chat_template=None)
    assert model_tok.encode(text) == whole


def test_normalizer_or_one_core_means_whole(smollm):
    assert splittable(smollm.backend)
    assert not splittable(_variant(smollm, _lowercase))
    assert PieceEncoder(smollm.backend, threads=1).max_pieces == 1
    assert PieceEncoder(smollm.backend, threads=2).max_pieces == 4
