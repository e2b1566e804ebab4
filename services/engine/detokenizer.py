"""Incremental detokenization that never emits a broken character.

    detok = IncrementalDetokenizer(tokenizer)      # ModelTokenizer or tokenizers.Tokenizer
    for tid in sampled: out += detok.push(tid)
    out += detok.flush()                           # == tokenizer.decode(all ids)

Decodes a sliding window (the tokens since the last emitted boundary plus the previous few for
context), the scheme vLLM and TGI use: a window that starts mid-text decodes consistently
for byte-level BPE and for SentencePiece decoders that strip the first space, because the
emitted delta is always new_text[len(prefix_text):] over the same window start. Text ending in
U+FFFD (an incomplete multi-byte character, e.g. the first byte-fallback token of an emoji)
is held back until the character completes.
"""
from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, skip_special_tokens: bool = True,
                 context_ids: Sequence[int] = ()):
        """tokenizer: a ModelTokenizer (its raw `backend` is used) or a tokenizers.Tokenizer.
        context_ids: tokens before the output (e.g. the prompt's last few), decoded only to
        give the first output token its context; their text is never emitted."""
        self._tok = getattr(tokenizer, "backend", tokenizer)
        self._skip = skip_special_tokens
        self._ids: list[int] = list(context_ids)
        self._context = len(self._ids)
        # Window [prefix_offset, read_offset) is already emitted text used as context.
        self._prefix_offset = max(0, self._context - 5)
        self._read_offset = self._context
        self._emitted: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._context:]

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Adds one token; returns the new text that is safe to show (may be '')."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""  # nothing new, or a character still incomplete
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """At the end: the held-back remainder (an incomplete character stays U+FFFD)."""
        if self._context == 0:
            full = self._decode(self._ids)
            done = self.text
            if full.startswith(done):
                delta = full[len(done):]
                self._emitted.append(delta)
                self._prefix_offset = self._read_offset = len(self._ids)
                return delta
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self._emitted.append(delta)
        return delta
