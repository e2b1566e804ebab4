"""Encode / decode / count for named models: input checks, then the work.

Plain dataclasses in and out (the servicer converts protobuf). Called on the gRPC server's
handler threads (the tokenizer runs the synchronous server), so the work runs right there
through library calls that release the GIL: a batch spreads over the library's threads, one
long text over the handler thread and helpers (tokenserve/piece_encoding.py).
Tokenizers load on the asyncio loop (the registry); a handler waits only for a first load.
"""
from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from services.tokenizer.registry import TokenizerRegistry
from tokenserve.runtime.errors import InvalidArgument
from tokenserve.text import check_no_nul
from tokenserve.tokenization import ModelTokenizer


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str


@dataclass(frozen=True)
class EncodeInput:
    """Exactly one of `text` and `messages` is set."""

    text: str | None = None
    messages: tuple[ChatTurn, ...] | None = None
    add_generation_prompt: bool = False
    add_special_tokens: bool = False
    parse_special: bool = False


@dataclass(frozen=True)
class Encoded:
    token_ids: list[int]
    # Rendered chat prompt length in characters; 0 for text.
    rendered_chars: int = 0


@dataclass(frozen=True)
class DecodeInput:
    token_ids: Sequence[int]
    skip_special_tokens: bool = False


@dataclass(frozen=True)
class TokenizerInfo:
    model: str
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    special_token_ids: tuple[int, ...]
    has_chat_template: bool
    max_text_bytes: int


class Tokenization:
    def __init__(self, registry: TokenizerRegistry, loop: asyncio.AbstractEventLoop, *,
                 max_text_bytes: int, max_batch_items: int):
        """`loop`: the event loop that loads tokenizers (the registry's)."""
        self.registry = registry
        self._loop = loop
        self.max_text_bytes = max_text_bytes
        self.max_batch_items = max_batch_items

    def encode(self, model: str, inputs: Sequence[EncodeInput], *,
               batch: bool = False) -> list[Encoded]:
        """`batch`: name fields `requests[i].…` in errors (the batch RPCs)."""
        self._check_batch(len(inputs), batch)
        for i, item in enumerate(inputs):
            self._check_input(item, f"requests[{i}]." if batch else "")
        return _encode_all(self.registry.get_blocking(model, self._loop), inputs)

    def decode(self, model: str, inputs: Sequence[DecodeInput], *,
               batch: bool = False) -> list[str]:
        self._check_batch(len(inputs), batch)
        tok = self.registry.get_blocking(model, self._loop)
        for i, item in enumerate(inputs):
            tok.check_ids(item.token_ids, field=f"requests[{i}].token_ids" if batch else "token_ids")
        return _decode_all(tok, inputs)

    def info(self, model: str) -> TokenizerInfo:
        tok = self.registry.get_blocking(model, self._loop)
        return TokenizerInfo(
            model=model, vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, special_token_ids=tuple(sorted(tok.special_token_ids)),
            has_chat_template=tok.chat_template is not None, max_text_bytes=self.max_text_bytes)

    def _check_batch(self, n: int, batch: bool) -> None:
        if not batch:
            return
        if n == 0:
            raise InvalidArgument("requests is empty: send at least one request in the batch")
        if n > self.max_batch_items:
            raise InvalidArgument(
                f"requests holds {n} items; the limit is {self.max_batch_items} per batch",
                metadata=(("max-batch-items", str(self.max_batch_items)),))

    def _check_input(self, item: EncodeInput, prefix: str) -> None:
        if item.text is not None:
            check_no_nul(item.text, f"{prefix}text")
            # A character is 1..4 UTF-8 bytes: only measure when the text could be over.
            if len(item.text) * 4 > self.max_text_bytes:
                self._check_size(len(item.text.encode("utf-8")), f"{prefix}text")
            return
        if item.messages is None:
            raise InvalidArgument(f"{prefix}input is missing: set text or chat")
        if not item.messages:
            raise InvalidArgument(f"{prefix}chat.messages is empty: send at least one message")
        total = 0
        for j, turn in enumerate(item.messages):
            for name in ("role", "content"):
                value = getattr(turn, name)
                check_no_nul(value, f"{prefix}chat.messages[{j}].{name}")
                total += len(value.encode("utf-8"))
        self._check_size(total, f"{prefix}chat")

    def _check_size(self, size: int, field: str) -> None:
        if size > self.max_text_bytes:
            raise InvalidArgument(
                f"{field} is {size} bytes of UTF-8; the limit is {self.max_text_bytes} bytes "
                "per input", metadata=(("max-text-bytes", str(self.max_text_bytes)),))


def _encode_all(tok: ModelTokenizer, inputs: Sequence[EncodeInput]) -> list[Encoded]:
    out: list[Encoded | None] = [None] * len(inputs)
    texts: dict[tuple[bool, bool], list[int]] = defaultdict(list)
    for i, item in enumerate(inputs):
        if item.text is not None:
            texts[(item.add_special_tokens, item.parse_special)].append(i)
            continue
        messages = [{"role": t.role, "content": t.content} for t in item.messages or ()]
        if item.parse_special:  # trusted caller: the whole rendering is parsed
            rendered = tok.render_chat(messages, add_generation_prompt=item.add_generation_prompt)
            out[i] = Encoded(tok.encode(rendered, parse_special=True), len(rendered))
        else:
            ids, chars = tok.encode_chat_rendered(
                messages, add_generation_prompt=item.add_generation_prompt)
            out[i] = Encoded(ids, chars)
    for (add_special, parse_special), indices in texts.items():
        batches = tok.encode_batch([inputs[i].text for i in indices],  # GIL released
                                   add_special_tokens=add_special, parse_special=parse_special)
        for i, ids in zip(indices, batches):
            out[i] = Encoded(ids)
    return out  # type: ignore[return-value]


def _decode_all(tok: ModelTokenizer, inputs: Sequence[DecodeInput]) -> list[str]:
    # decode_batch, even for one input: it releases the GIL.
    out: list[str] = [""] * len(inputs)
    groups: dict[bool, list[int]] = defaultdict(list)
    for i, item in enumerate(inputs):
        groups[item.skip_special_tokens].append(i)
    for skip, indices in groups.items():
        texts = tok.decode_batch([inputs[i].token_ids for i in indices], skip_special_tokens=skip)
        for i, text in zip(indices, texts):
            out[i] = text
    return out
