"""A `tokenizers.Tokenizer` built from the tokenizer metadata of a GGUF file.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, token types and
special ids as metadata. This reads only the key/value header (no tensors, ~0.3 s for a 49k
vocabulary, where `gguf.GGUFReader` takes seconds) and rebuilds the tokenizer that
transformers builds from the same file, with one deliberate difference: the pre-tokenizer
follows `tokenizer.ggml.pre` the way llama.cpp does, also for names transformers does not
know (SmolLM's "smollm" splits every digit, as its original tokenizer.json does).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# Regexes llama.cpp applies before byte-level BPE, by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_PRE = {name: _LLAMA3_SPLIT for name in (
    "llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral")}
_SPLIT_PRE.update({name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen", "megrez")})
# GPT-2's regex alone (ByteLevel's built-in split).
_GPT2_PRE = {"default", "gpt-2", "gpt2", "jina-es", "jina-de", "olmo", "mpt", "phi-2"}
# Every digit on its own, then GPT-2's regex (StarCoder-family tokenizers).
_DIGITS_PRE = {"smollm", "starcoder", "refact"}


class GGUFTokenizerError(ValueError):
    """The file is not a GGUF, or describes a tokenizer this module cannot rebuild."""


@dataclass(frozen=True)
class GGUFTokenizer:
    backend: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    special_token_ids: frozenset[int]
    chat_template: str | None
    # Strings of bos/eos/unk/pad as chat templates read them (bos_token, eos_token, ...).
    template_vars: dict[str, str]


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """The key/value header of a GGUF file (arrays of numbers as lists, strings decoded)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFTokenizerError("not a GGUF file (bad magic)")
        (version,) = struct.unpack("<I", f.read(4))
        if version not in (2, 3):
            raise GGUFTokenizerError(f"unsupported GGUF version {version} (need 2 or 3)")
        _tensors, kv_count = struct.unpack("<QQ", f.read(16))
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = _read_string(f)
            (vtype,) = struct.unpack("<I", f.read(4))
            metadata[key] = _read_value(f, vtype)
        return metadata


def _read_string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="surrogateescape")


def _read_value(f: BinaryIO, vtype: int) -> Any:
    if vtype == _STRING:
        return _read_string(f)
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if vtype == _ARRAY:
        itype, count = struct.unpack("<IQ", f.read(12))
        if itype == _STRING:
            out = []
            for _ in range(count):
                (n,) = struct.unpack("<Q", f.read(8))
                out.append(f.read(n).decode("utf-8", errors="surrogateescape"))
            return out
        if itype in _SCALARS:
            fmt = _SCALARS[itype]
            size = struct.calcsize(fmt)
            return list(struct.unpack(f"<{count}{fmt[1]}", f.read(size * count)))
        return [_read_value(f, itype) for _ in range(count)]
    raise GGUFTokenizerError(f"unknown GGUF value type {vtype}")


def build_gguf_tokenizer(path: Path) -> GGUFTokenizer:
    meta = read_gguf_metadata(path)
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise GGUFTokenizerError("the file carries no tokenizer (tokenizer.ggml.model/tokens)")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if model == "gpt2":
        backend = _byte_level_bpe(tokens, meta)
        add_bos_default = False
    elif model == "llama":
        backend = _sentencepiece_bpe(tokens, meta)
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        add_bos_default = True
    else:
        raise GGUFTokenizerError(
            f"tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2', 'llama')")

    special_ids = _add_gguf_tokens(backend, tokens, types, byte_level=model == "gpt2")
    ids = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in (
        ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
        ("pad", "padding_token_id"))}
    for name, token_id in ids.items():
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise GGUFTokenizerError(f"tokenizer.ggml.{name} id {token_id} is outside the vocabulary")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    _set_post_processor(backend, tokens, ids["bos"] if add_bos else None,
                        ids["eos"] if add_eos else None)
    template_vars = {f"{name}_token": tokens[token_id] for name, token_id in ids.items()
                     if token_id is not None}
    return GGUFTokenizer(
        backend=backend, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
        unk_token_id=ids["unk"], pad_token_id=ids["pad"], special_token_ids=special_ids,
        chat_template=meta.get("tokenizer.chat_template"), template_vars=template_vars)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable spelling of every byte (the byte-level BPE alphabet).
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_SPELLING = _bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_SPELLING.values())


def _byte_level_bpe(tokens: list[str], meta: dict[str, Any]) -> Tokenizer:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise GGUFTokenizerError("a 'gpt2' tokenizer needs tokenizer.ggml.merges")
    # Tokens are stored in the byte alphabet already; respell any that are not (as transformers).
    vocab = {(t if set(t) <= _BYTE_ALPHABET
              else "".join(_BYTE_SPELLING[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None,
                                   continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in _DIGITS_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _SPLIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _GPT2_PRE:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        # Guessing would give silently wrong ids, and token counts are billed.
        raise GGUFTokenizerError(
            f"tokenizer.ggml.pre {pre!r} is not supported; known: "
            f"{sorted(_DIGITS_PRE | set(_SPLIT_PRE) | _GPT2_PRE)}")
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], meta: dict[str, Any]) -> Tokenizer:
    """llama.cpp's "llama" vocabulary: SentencePiece BPE with byte fallback, as LlamaTokenizer."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise GGUFTokenizerError("a 'llama' tokenizer needs tokenizer.ggml.scores or merges")
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                   dropout=None, unk_token=_unk(tokens, meta)))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1)])
    return backend


def _unk(tokens: list[str], meta: dict[str, Any]) -> str | None:
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    return tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    # Every split of every token into two known pieces, best-scored token first (transformers'
    # `generate_merges`, so both give the same merge order).
    merges = []
    for merged, score in scores.items():
        local = [(merged[:i], merged[i:], score) for i in range(1, len(merged))
                 if merged[:i] in vocab and merged[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_gguf_tokens(backend: Tokenizer, tokens: list[str], types: list[int], *,
                     byte_level: bool) -> frozenset[int]:
    """CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens.

    In a byte-level vocabulary a "control" token spelled outside the byte alphabet is a
    llama.cpp mislabel; like transformers, it is left as an ordinary vocabulary entry.
    """
    control = [t for t, ty in zip(tokens, types)
               if ty == TOKEN_CONTROL and (not byte_level or set(t) <= _BYTE_ALPHABET)]
    if control:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return frozenset(backend.token_to_id(t) for t in control)


def _set_post_processor(backend: Tokenizer, tokens: list[str], bos: int | None,
                        eos: int | None) -> None:
    if bos is None and eos is None:
        backend.post_processor = None
        return
    specials = [(tokens[i], i) for i in (bos, eos) if i is not None]
    single = " ".join(([f"{tokens[bos]}:0"] if bos is not None else []) + ["$A:0"]
                      + ([f"{tokens[eos]}:0"] if eos is not None else []))
    pair = single + " " + " ".join(([f"{tokens[bos]}:1"] if bos is not None else []) + ["$B:1"]
                                   + ([f"{tokens[eos]}:1"] if eos is not None else []))
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials)
