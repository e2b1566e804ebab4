"""A model's tokenizer, loaded from the model artifact itself (GGUF file or Hugging Face folder).

    tok = load_model_tokenizer(default_model_path())
    ids = tok.encode("Hello")                        # user text: never becomes control tokens
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])   # template tokens stay special
    text = tok.decode(ids)

Shared by the tokenizer service (counts, billing) and the engine (prompt ids, detokenizing), so
both see the same ids. Ids equal transformers' for the same artifact (see tests/unit/tokenization).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tokenserve.chat_template import ChatTemplate, ChatTemplateError, template_literal_text
from tokenserve.gguf_tokenizer import GGUFTokenizerError, build_gguf_tokenizer
from tokenserve.piece_encoding import PieceEncoder
from tokenserve.runtime.errors import FailedPrecondition, InvalidArgument

__all__ = ["ChatTemplateError", "ModelTokenizer", "TokenizerLoadError", "load_model_tokenizer",
           "MAX_TEXT_BYTES"]

# The largest text (or chat, every string together) one input may hold, in UTF-8 bytes: the
# tokenizer service's default --max-text-bytes and the gateway's prompt limit.
MAX_TEXT_BYTES = 1024 * 1024


class TokenizerLoadError(FailedPrecondition):
    """The artifact at `path` has no usable tokenizer; `reason` says why."""

    def __init__(self, path: str | Path, reason: str):
        super().__init__(f"cannot load a tokenizer from {path}: {reason}")
        self.path = Path(path)
        self.reason = reason


class ModelTokenizer:
    """Encode/decode/chat for one model. Thread-safe: the encoders are never mutated after init.

    `backend` encodes caller text with special-token strings taken literally (as plain text);
    pass `parse_special=True` to let "<|im_start|>" in the text become the control token.
    """

    def __init__(self, backend: Tokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 special_token_ids: frozenset[int], chat_template: str | None,
                 template_vars: Mapping[str, str] | None = None):
        # Two copies, because `encode_special_tokens` is a property of the object, not of a call.
        # `backend` is taken over (callers build it for this object).
        self._parsing = backend
        self._parsing.encode_special_tokens = False
        self.backend = Tokenizer.from_str(backend.to_str())
        self.backend.encode_special_tokens = True
        self._encoder = PieceEncoder(backend)  # long texts on several cores where exact
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.special_token_ids = frozenset(special_token_ids)
        self.chat_template = chat_template
        self._template: ChatTemplate | None = None
        if chat_template is not None:
            self._template = ChatTemplate(
                chat_template, template_vars=template_vars or {},
                control_tokens=_control_tokens(backend, chat_template))
        self._newline_ids = self._parsing.encode("\n", add_special_tokens=False).ids

    # -- text ----------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False,
               parse_special: bool = False) -> list[int]:
        """The ids of one text; a long one is encoded on several cores at once (piece_encoding)."""
        return self._encoder.encode(self._parsing if parse_special else self.backend, text,
                                    add_special_tokens=add_special_tokens)

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = False,
                     parse_special: bool = False) -> list[list[int]]:
        """Same ids as `encode` per text; the library spreads the batch over its own threads."""
        if len(texts) == 1:
            return [self.encode(texts[0], add_special_tokens=add_special_tokens,
                                parse_special=parse_special)]
        tok = self._parsing if parse_special else self.backend
        return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Raises InvalidArgument naming the first id outside [0, vocab_size)."""
        self.check_ids(ids)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], *,
                     skip_special_tokens: bool = True) -> list[str]:
        for ids in batch:
            self.check_ids(ids)
        return self.backend.decode_batch([list(ids) for ids in batch],
                                         skip_special_tokens=skip_special_tokens)

    def check_ids(self, ids: Sequence[int], *, field: str = "token_ids") -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            index, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < self.vocab_size)
            raise InvalidArgument(
                f"{field}[{index}] = {bad} is not a token id: the vocabulary has {self.vocab_size}"
                f" tokens (ids 0..{self.vocab_size - 1})")

    # -- chat ----------------------------------------------------------------------------

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True) -> str:
        """The conversation as prompt text, exactly as transformers' apply_chat_template renders it."""
        return self._require_template().render(messages, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True) -> list[int]:
        """Render and encode; only the template's own control tokens become control tokens.

        Ids equal transformers' `apply_chat_template(..., tokenize=True,
        sanitize_control_tokens=True)`; without control-token text in the messages they equal
        plain `apply_chat_template(..., tokenize=True)`.
        """
        return self.encode_chat_rendered(messages, add_generation_prompt=add_generation_prompt)[0]

    def encode_chat_rendered(self, messages: Sequence[Mapping[str, Any]], *,
                             add_generation_prompt: bool = True) -> tuple[list[int], int]:
        """`encode_chat`'s ids and the rendered prompt's length in characters."""
        template = self._require_template()
        rendered = template.render(messages, add_generation_prompt=add_generation_prompt,
                                   mark_control_tokens=True)
        # [text, marked token (or None for a lone marker), text, marked token, ..., text]
        pieces = template.marker_re.split(rendered)
        ids = self._parsing.encode(pieces[0], add_special_tokens=False).ids
        chars = len(pieces[0])
        for i, piece in enumerate(pieces[1:], start=1):
            if piece:
                ids += self._encode_piece(piece, as_text=i % 2 == 1)
                chars += len(piece)
        return ids, chars

    def _encode_piece(self, piece: str, *, as_text: bool) -> list[int]:
        tok = self.backend if as_text else self._parsing
        # Encoded after a newline that is then dropped, so a SentencePiece prefix space is not
        # added in mid-chat (same trick as transformers, hence the same ids).
        ids = tok.encode("\n" + piece, add_special_tokens=False).ids
        n = len(self._newline_ids)
        if ids[:n] == self._newline_ids:
            return ids[n:]
        return tok.encode(piece, add_special_tokens=False).ids

    def _require_template(self) -> ChatTemplate:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template: send plain text instead")
        return self._template


def _control_tokens(backend: Tokenizer, chat_template: str) -> tuple[str, ...]:
    # Special added tokens, plus non-special added tokens the template writes itself (transformers'
    # rule, minus whitespace tokens that templates contain as ordinary text).
    literal = template_literal_text(chat_template)
    return tuple(t.content for t in backend.get_added_tokens_decoder().values()
                 if t.special or (t.content in literal and not t.content.isspace()))


def load_model_tokenizer(path: str | Path) -> ModelTokenizer:
    """The tokenizer of a GGUF file or a Hugging Face folder (tokenizer.json + tokenizer_config.json)."""
    p = Path(path)
    if p.is_dir():
        return _load_hf_folder(p)
    if not p.is_file():
        raise TokenizerLoadError(p, "no such file or directory")
    try:
        g = build_gguf_tokenizer(p)
    except GGUFTokenizerError as exc:
        raise TokenizerLoadError(p, str(exc)) from exc
    except (OSError, EOFError) as exc:
        raise TokenizerLoadError(p, f"unreadable: {exc}") from exc
    except Exception as exc:  # struct/tokenizers errors on a corrupt header
        raise TokenizerLoadError(p, f"corrupt GGUF tokenizer metadata ({type(exc).__name__}: {exc})") from exc
    try:
        return ModelTokenizer(g.backend, bos_token_id=g.bos_token_id, eos_token_id=g.eos_token_id,
                              special_token_ids=g.special_token_ids, chat_template=g.chat_template,
                              template_vars=g.template_vars)
    except ChatTemplateError as exc:
        raise TokenizerLoadError(p, exc.message) from exc


def _load_hf_folder(folder: Path) -> ModelTokenizer:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:
            return load_model_tokenizer(ggufs[0])
        raise TokenizerLoadError(folder, "no tokenizer.json (and not exactly one .gguf file) in the folder")
    try:
        backend = Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise TokenizerLoadError(folder, f"malformed tokenizer.json: {exc}") from exc
    config = _read_json(folder / "tokenizer_config.json")
    template = _chat_template(folder, config)
    template_vars: dict[str, str] = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            template_vars[name] = value
    ids = {name: backend.token_to_id(value) for name, value in template_vars.items()}
    special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    try:
        return ModelTokenizer(backend, bos_token_id=ids.get("bos_token"),
                              eos_token_id=ids.get("eos_token"), special_token_ids=special,
                              chat_template=template, template_vars=template_vars)
    except ChatTemplateError as exc:
        raise TokenizerLoadError(folder, exc.message) from exc


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(path, f"unreadable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(path, "expected a JSON object")
    return data


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None
