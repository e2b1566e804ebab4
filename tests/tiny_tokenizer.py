"""A tiny tokenizer-only GGUF file (a SentencePiece "llama" vocabulary, no weights) for the
tokenizer's tests: loading, the service logic and the tokenizer service."""
from __future__ import annotations

from pathlib import Path

import gguf

# A tiny SentencePiece ("llama") vocabulary: unk/bos/eos, 256 byte tokens, scored pieces.
SPM_PIECES = ["▁", "e", "h", "l", "o", "w", "r", "d", "t", "a", "i", "n", "s", "▁h", "he", "ll",
              "lo", "▁w", "or", "ld", "▁t", "th", "▁the", "▁he", "hel", "hell", "hello",
              "▁hello", "▁wor", "▁world", "in", "is", "▁is", "te", "tes", "test", "▁test", "你",
              "好"]


def write_gguf(path: Path, *, model: str = "llama", pre: str | None = None,
               chat_template: str | None = "{% for m in messages %}<|user|>{{ m['content'] }}</s>"
                                            "{% endfor %}") -> Path:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + ["<|user|>"]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [3]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
