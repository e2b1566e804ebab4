"""Encode one long text on several cores: cut it where the ids cannot change, encode the pieces
on the calling thread and on helper threads at once, concatenate.

    encoder = PieceEncoder(tokenizer)              # cuts only where splittable(tokenizer)
    ids = encoder.encode(tokenizer, text)          # == tokenizer.encode(text).ids

The library spreads a batch over its threads but encodes one text on one thread. Handing it the
pieces as a batch does not help here: the calling thread sleeps while the library's threads wake
up, so each wake-up lands on the critical path (on a 2-core VM that was slower than one thread).
Instead the calling thread starts on the pieces at once, helpers join as they wake, and a helper
that has not started by the time the pieces are done is cancelled, never waited for. On 2 cores
a 16 KB prompt takes about half the one-thread time, RPC included (bench/tokenizer.py), and a
1 KB one ~70% (in-process, caches cold as between a service's calls).

Exact only where the pre-tokenizer never joins a word to the whitespace after it. `splittable`
accepts byte-level BPE with GPT-2's split regex (optionally after Digits), no normalizer, no
post-processor tokens, no truncation or padding, and no added token that strips whitespace or
spans a word-whitespace edge; anything else is encoded whole. The cut goes between a printable,
non-space character c and an ASCII whitespace w. GPT-2's regex
`'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+` has no
lookbehind, and each alternative that can hold c stops at whitespace and at the end of the text
alike (whitespace appears in it only as a leading space), so the pre-tokens up to c are the same
in the whole text and in the first piece, one of them ends at the cut, and the search from w
onwards sees the same characters. BPE works within a pre-token, so the ids concatenate. Digits
only isolates digits, and an added token cannot cover both c and w. "Printable" keeps out every
character some Unicode table might call whitespace (separators, controls, format characters),
so the regex's idea of whitespace cannot differ from ours on either side of the cut.
"""
from __future__ import annotations

import itertools
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

from tokenizers import Tokenizer

MIN_PIECE_CHARS = 192  # a shorter piece costs more to hand over than it saves
PIECES_PER_CORE = 2    # a late helper leaves less undone when the pieces are small

_CUT = re.compile(r"(?<=\S)[ \t\n\r]")
_WORD_SPACE = re.compile(r"\S[ \t\n\r]")


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def splittable(tokenizer: Tokenizer) -> bool:
    """True when cutting text as `split_text` does cannot change this tokenizer's ids. Reads the
    tokenizer's parts, never its whole serialisation (megabytes of vocabulary and merges)."""
    t = tokenizer
    if t.normalizer is not None or t.truncation is not None or t.padding is not None:
        return False
    if t.post_processor is not None and type(t.post_processor).__name__ != "ByteLevel":
        return False  # ByteLevel only trims offsets; the others add tokens
    if type(t.model).__name__ != "BPE" or t.model.dropout not in (None, 0.0):
        return False
    if t.pre_tokenizer is None:
        return False
    pre = json.loads(t.pre_tokenizer.__getstate__())
    steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    if not steps or any(s.get("type") != "Digits" for s in steps[:-1]):
        return False
    last = steps[-1]
    if last.get("type") != "ByteLevel" or not last.get("use_regex", True) \
            or last.get("add_prefix_space", True):
        return False
    return not any(a.lstrip or a.rstrip or a.single_word or _WORD_SPACE.search(a.content)
                   for a in t.get_added_tokens_decoder().values())


def split_text(text: str, pieces: int, *, min_chars: int = MIN_PIECE_CHARS) -> list[str]:
    """At most `pieces` pieces of at least ~`min_chars` characters, cut where the ids are unchanged
    (see the module docstring); fewer where the text has no such places (e.g. no spaces)."""
    pieces = min(pieces, len(text) // min_chars)
    if pieces < 2:
        return [text]
    cuts = [0]
    for k in range(1, pieces):
        at = max(len(text) * k // pieces, cuts[-1] + 1)
        while (m := _CUT.search(text, at)) is not None and not text[m.start() - 1].isprintable():
            at = m.start() + 1
        if m is None:
            break
        cuts.append(m.start())
    cuts.append(len(text))
    return [text[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


class PieceEncoder:
    """Encodes a tokenizer's texts, long ones in pieces where `splittable` allows and there are
    several cores, otherwise whole. Thread-safe; holds no per-text state. Its helper threads
    start with the first long text."""

    def __init__(self, tokenizer: Tokenizer, *, threads: int | None = None):
        threads = threads or cores()
        self.max_pieces = threads * PIECES_PER_CORE if threads > 1 and splittable(tokenizer) else 1
        self._helpers = ThreadPoolExecutor(max(1, threads - 1), thread_name_prefix="encode-piece")
        self._threads = threads

    def encode(self, tok: Tokenizer, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """`tok`: the tokenizer given at construction, or a copy of it (same configuration)."""
        # encode_batch_fast: no character offsets (~25% less time than the library's `encode`,
        # same ids); one text runs on the calling thread, GIL released
        pieces = split_text(text, self.max_pieces)
        if len(pieces) == 1:
            return tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        done: list[list[int]] = [[] for _ in pieces]
        claim = itertools.count()  # next() is atomic under the GIL: each piece is claimed once

        def work() -> None:
            while (i := next(claim)) < len(pieces):
                done[i] = tok.encode_batch_fast([pieces[i]], add_special_tokens=add_special_tokens)[0].ids

        helpers = [self._helpers.submit(work) for _ in range(min(self._threads, len(pieces)) - 1)]
        work()
        for h in helpers:
            if not h.cancel():  # started: it holds a piece (or is about to see none are left)
                h.result()
        ids = done[0]
        for more in done[1:]:
            ids += more
        return ids
