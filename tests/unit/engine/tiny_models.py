"""Tiny random Llama models written to disk: GGUF (gguf's own GGUFWriter) and HF folders.

The GGUF writer mirrors llama.cpp's converter, Q/K rows permuted for its RoPE layout, so the
loader's un-permute is exercised exactly as with a real file.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

VOCAB = 96
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTER = 128
LAYERS = 2
MAX_POS = 512
THETA = 10000.0
EPS = 1e-5


def random_weights(seed: int = 0, *, tied: bool = False) -> dict[str, torch.Tensor]:
    """HF-named float32 weights, scaled so logits are decisive (greedy is not a coin toss)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": rnd(VOCAB, HIDDEN, std=1.0),
         "model.norm.weight": 1 + rnd(HIDDEN, std=0.1)}
    if not tied:
        w["lm_head.weight"] = rnd(VOCAB, HIDDEN, std=0.3)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rnd(HIDDEN, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(HIDDEN, std=0.1)
        w[p + "self_attn.q_proj.weight"] = rnd(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = rnd(HIDDEN, HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = rnd(INTER, HIDDEN)
        w[p + "mlp.up_proj.weight"] = rnd(INTER, HIDDEN)
        w[p + "mlp.down_proj.weight"] = rnd(HIDDEN, INTER)
    return w


def hf_config(*, tied: bool = False, model_type: str = "llama") -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": model_type, "vocab_size": VOCAB,
            "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "max_position_embeddings": MAX_POS, "rms_norm_eps": EPS, "rope_theta": THETA,
            "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu", "torch_dtype": "float32"}


def tokenizer_json() -> str:
    """A word-level tokenizer over t0..t{VOCAB-1} (enough for loading and decoding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def write_hf(folder: Path, weights: dict[str, torch.Tensor], *, tied: bool = False,
             tokenizer: bool = True, config: dict | None = None) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or hf_config(tied=tied)))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    if tokenizer:
        (folder / "tokenizer.json").write_text(tokenizer_json())
    return folder


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K permutation (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(path: Path, weights: dict[str, torch.Tensor], qtype: str = "F32", *,
               arch: str = "llama", tokenizer: bool = True, name: str = "tiny-llama",
               raw_q_type: str | None = None) -> Path:
    """qtype: F32, F16 or any type gguf.quants can quantize (Q8_0, ...) for 2-D weights.
    raw_q_type: store blk.0.attn_q.weight as zero bytes of this type (e.g. one the gguf
    package cannot dequantize)."""
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(LAYERS)
    w.add_context_length(MAX_POS)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_freq_base(THETA)
    w.add_vocab_size(VOCAB)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(VOCAB)])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    for key, t in weights.items():
        a = t.numpy().astype(np.float32)
        base = key.removesuffix(".weight")
        if base == "model.embed_tokens":
            gname = "token_embd"
        elif base == "model.norm":
            gname = "output_norm"
        elif base == "lm_head":
            gname = "output"
        else:
            _, _, i, rest = base.split(".", 3)
            gname = f"blk.{i}.{_GGUF_NAMES[rest]}"
            if rest == "self_attn.q_proj":
                a = _permute(a, HEADS)
            elif rest == "self_attn.k_proj":
                a = _permute(a, KV_HEADS)
        gname += ".weight"
        if raw_q_type and gname == "blk.0.attn_q.weight":
            rt = gguf.GGMLQuantizationType[raw_q_type]
            block, size = gguf.GGML_QUANT_SIZES[rt]
            w.add_tensor(gname, np.zeros((a.shape[0], a.shape[1] // block * size), np.uint8), raw_dtype=rt)
        elif a.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, a)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, a.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(a, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
