"""Load a Llama-family model from a GGUF file or a Hugging Face folder into float32 tensors.

Both formats end in one canonical form, `LoadedWeights`: a `ModelConfig` plus a dict of
float32 tensors named

    embed [V, E]    norm [E]    lm_head [V, E] (absent when tied)    rope_freqs [D/2] (optional)
    layers.{i}.{attn_norm, ffn_norm} [E]
    layers.{i}.wq [H*D, E]  .wk / .wv [Hkv*D, E]  .wo [E, H*D]
    layers.{i}.w_gate / .w_up [I, E]  .w_down [E, I]

with Q/K rows in the Hugging Face ("rotate half") RoPE layout. GGUF stores Q/K permuted for
llama.cpp's interleaved RoPE; `_unpermute` undoes it exactly as transformers' GGUF loader does.
Anything that cannot be loaded raises `ModelLoadError(path, reason)` before the engine serves.

keep_blocks=True (GGUF only): the linear weights whose block format has a kernel
(gguf_kernels.FORMATS) are kept as the file's own blocks in `quantized` (same names and row
order, Q/K rows un-permuted the same way) instead of being dequantized into `tensors`; the
token embedding is kept both ways (its rows are gathered as floats, and the tied output head
multiplies its blocks).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from services.engine.gguf_kernels import FORMATS as BLOCK_FORMATS, GGUFWeight
from tokenserve.runtime.logging import get_logger

log = get_logger(component="engine.loader")

Progress = Callable[[int, int], None]

SUPPORTED_ARCHITECTURES = ("llama",)  # GGUF general.architecture / HF model_type


class ModelLoadError(Exception):
    """The model at `path` cannot be served; `reason` says why and what to fix."""

    def __init__(self, path: str | Path, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot load model {self.path}: {reason}")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool
    # HF-style rope_scaling dict ({"rope_type": "linear"|"llama3", "factor": ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # name -> the file's own blocks (load_weights(keep_blocks=True) only)
    quantized: dict[str, GGUFWeight] = field(default_factory=dict)
    seconds: float = 0.0


def load_weights(path: str | Path, progress: Progress | None = None, *,
                 keep_blocks: bool = False) -> LoadedWeights:
    """GGUF file or Hugging Face folder -> LoadedWeights; raises ModelLoadError."""
    path = Path(path)
    t0 = time.perf_counter()
    if not path.exists():
        raise ModelLoadError(path, "no such file or directory")
    if path.is_dir():
        loaded = _load_hf(path, progress)
    elif path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
        loaded = _load_gguf(path, progress, keep_blocks)
    else:
        raise ModelLoadError(path, "not a GGUF file (no GGUF magic) and not a Hugging Face folder")
    _check_shapes(path, loaded)
    loaded.seconds = time.perf_counter() - t0
    log.info("model_loaded", path=str(path), name=loaded.config.name,
             tensors=len(loaded.tensors), seconds=round(loaded.seconds, 2))
    return loaded


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


class _ProgressLog:
    """Calls the progress callback per tensor and logs every ~10%."""

    def __init__(self, path: Path, total: int, progress: Progress | None):
        self.path, self.total, self.progress, self.done, self._next_log = path, total, progress, 0, 0.1

    def step(self) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total)
        if self.done >= self.total * self._next_log or self.done == self.total:
            log.info("model_loading", path=str(self.path), tensors_done=self.done, tensors_total=self.total)
            self._next_log = self.done / self.total + 0.1


# ---------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "attn_q": "wq", "attn_k": "wk",
    "attn_v": "wv", "attn_output": "wo", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head",
                      "rope_freqs": "rope_freqs"}


# Canonical names of the weights a kernel multiplies (the embedding: as the tied output head).
_LINEAR_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head", "embed")


def _gguf_reader(path: Path):
    """gguf-py's reader over a plain array view of its memory map: it reads the metadata (a
    49,152-token vocabulary and its merges: ~1.2M small slices) by slicing the map, and each
    slice of a numpy memmap runs the subclass's hooks. The same fields and tensors, still
    mapped, not copied; SmolLM2's file on a 2-core Zen 1: 5.7 -> 2.2 s."""
    import gguf  # only needed for GGUF models

    class Reader(gguf.GGUFReader):
        def _build_fields(self, offs: int, count: int) -> int:
            self.data = self.data.view(np.ndarray)
            return super()._build_fields(offs, count)

    return Reader(path)


def _load_gguf(path: Path, progress: Progress | None, keep_blocks: bool = False) -> LoadedWeights:
    import gguf  # only needed for GGUF models

    try:
        reader = _gguf_reader(path)
    except Exception as e:  # the reader raises assorted errors on truncated or corrupt files
        raise ModelLoadError(path, f"corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(path, f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if reader.fields.get("tokenizer.ggml.tokens") is None:
        raise ModelLoadError(path, "GGUF file has no tokenizer (tokenizer.ggml.tokens missing)")
    required = ["block_count", "embedding_length", "feed_forward_length", "attention.head_count"]
    missing = [k for k in required if f"{arch}.{k}" not in reader.fields]
    if missing:
        raise ModelLoadError(path, f"GGUF metadata lacks {', '.join(arch + '.' + k for k in missing)}")

    n_heads = int(field(f"{arch}.attention.head_count"))
    n_kv = int(field(f"{arch}.attention.head_count_kv", n_heads))
    hidden = int(field(f"{arch}.embedding_length"))
    head_dim = int(field(f"{arch}.attention.key_length", hidden // n_heads))
    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError(path, "GGUF file has no token_embd.weight tensor")
    vocab = int(field(f"{arch}.vocab_size", int(embd.shape[1])))
    rope_scaling = None
    if field(f"{arch}.rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(field(f"{arch}.rope.scaling.factor", 1.0))}
    eos = field("tokenizer.ggml.eos_token_id")
    eot = field("tokenizer.ggml.eot_token_id")
    config = ModelConfig(
        name=str(field("general.name", path.stem)), vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_layers=int(field(f"{arch}.block_count")), num_heads=n_heads, num_kv_heads=n_kv,
        head_dim=head_dim, rms_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        max_position=int(field(f"{arch}.context_length", 2048)),
        tie_embeddings="output.weight" not in names, rope_scaling=rope_scaling,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(sorted({int(i) for i in (eos, eot) if i is not None})),
    )

    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, GGUFWeight] = {}
    prog = _ProgressLog(path, len(reader.tensors), progress)
    for t in reader.tensors:
        name = _gguf_canonical_name(t.name)
        if name is None:
            prog.step()
            continue  # tensors this architecture does not use
        if (keep_blocks and name.rsplit(".", 1)[-1] in _LINEAR_NAMES
                and t.tensor_type.name in BLOCK_FORMATS and len(t.shape) == 2):
            try:
                blocks = GGUFWeight(t.tensor_type.name, torch.from_numpy(np.array(t.data, dtype=np.uint8)),
                                    (int(t.shape[1]), int(t.shape[0])))
            except ValueError as e:
                raise ModelLoadError(path, f"tensor {t.name}: {e}; the file may be truncated") from e
            if name.endswith(".wq") or name.endswith(".wk"):
                heads = n_heads if name.endswith(".wq") else n_kv
                blocks = blocks.rows(_unpermute(torch.arange(blocks.shape[0]), heads))
            quantized[name] = blocks
            if name != "embed":
                prog.step()
                continue
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(path, f"tensor {t.name}: quantization type {t.tensor_type.name} "
                                       "is not supported by the gguf package") from e
        except Exception as e:
            raise ModelLoadError(path, f"tensor {t.name}: cannot dequantize "
                                       f"({type(e).__name__}: {e}); the file may be truncated") from e
        array = np.ascontiguousarray(array, dtype=np.float32)
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only map
            array = array.copy()
        w = torch.from_numpy(array)
        if name.endswith(".wq"):
            w = _unpermute(w, n_heads)
        elif name.endswith(".wk"):
            w = _unpermute(w, n_kv)
        tensors[name] = w
        prog.step()
    return LoadedWeights(config, tensors, quantized)


def _gguf_canonical_name(gguf_name: str) -> str | None:
    base = gguf_name.removesuffix(".weight")
    if base in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[base]
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    return None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp interleaved-pair rows -> HF rotate-half rows, per head. w: [n_head*D, E]."""
    d_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, d_half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


# ---------------------------------------------------------------- Hugging Face folder

_HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv",
    "self_attn.o_proj": "wo", "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up",
    "mlp.down_proj": "w_down",
}


def _load_hf(path: Path, progress: Progress | None) -> LoadedWeights:
    from safetensors import safe_open

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(path, "folder has no config.json")
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(path, "folder has no tokenizer.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "folder has no *.safetensors weights")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(path, f"config.json is not valid JSON ({e})") from e
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(path, f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ModelLoadError(path, "attention_bias/mlp_bias are not supported")
    try:
        config = hf_model_config(cfg, path.name)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(path, f"config.json is incomplete or invalid ({type(e).__name__}: {e})") from e

    tensors: dict[str, torch.Tensor] = {}
    try:
        handles = [safe_open(str(f), framework="pt") for f in files]
    except Exception as e:
        raise ModelLoadError(path, f"corrupt safetensors file ({type(e).__name__}: {e})") from e
    keys = [(h, k) for h in handles for k in h.keys()]
    prog = _ProgressLog(path, len(keys), progress)
    for h, key in keys:
        name = _hf_canonical_name(key)
        if name is not None:
            try:
                tensors[name] = h.get_tensor(key).to(torch.float32).contiguous()
            except Exception as e:
                raise ModelLoadError(path, f"tensor {key}: cannot read ({type(e).__name__}: {e})") from e
        prog.step()
    if config.tie_embeddings:
        tensors.pop("lm_head", None)
    return LoadedWeights(config, tensors)


def hf_model_config(cfg: dict, name: str) -> ModelConfig:
    """A Hugging Face config.json (as a dict) -> ModelConfig; KeyError/TypeError/ValueError
    when incomplete. name: used when the config names no model."""
    n_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    scaling = cfg.get("rope_scaling") or None
    rope_theta = cfg.get("rope_theta")
    if rope_theta is None:  # transformers >= 5 nests it in rope_parameters
        params = cfg.get("rope_parameters") or {}
        rope_theta = params.get("rope_theta", 10000.0)
        if params.get("rope_type", "default") != "default":
            scaling = params
    return ModelConfig(
        name=str(cfg.get("_name_or_path") or name) or name,
        vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
        num_heads=n_heads, num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
        max_position=int(cfg.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=scaling, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
    )


def loaded_from_state_dict(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> LoadedWeights:
    """A Hugging Face Llama state dict (e.g. a transformers model's, weights kept where they
    are: device and dtype) -> LoadedWeights, checked like a loaded folder."""
    tensors = {}
    for key, t in state_dict.items():
        name = _hf_canonical_name(key)
        if name is not None:
            tensors[name] = t.detach()
    if config.tie_embeddings:
        tensors.pop("lm_head", None)
    loaded = LoadedWeights(config, tensors)
    _check_shapes(Path(config.name), loaded)
    return loaded


def _hf_canonical_name(key: str) -> str | None:
    key = key.removesuffix(".weight")
    if key == "model.embed_tokens":
        return "embed"
    if key == "model.norm":
        return "norm"
    if key == "lm_head":
        return "lm_head"
    parts = key.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _HF_LAYER_NAMES:
        return f"layers.{parts[2]}.{_HF_LAYER_NAMES[parts[3]]}"
    return None


# ---------------------------------------------------------------- validation

def _check_shapes(path: Path, loaded: LoadedWeights) -> None:
    c, t = loaded.config, {**loaded.quantized, **loaded.tensors}
    e, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    want = {"embed": (c.vocab_size, e), "norm": (e,)}
    if not c.tie_embeddings:
        want["lm_head"] = (c.vocab_size, e)
    for n in range(c.num_layers):
        p = f"layers.{n}."
        want.update({p + "attn_norm": (e,), p + "ffn_norm": (e,), p + "wq": (c.num_heads * d, e),
                     p + "wk": (c.num_kv_heads * d, e), p + "wv": (c.num_kv_heads * d, e),
                     p + "wo": (e, c.num_heads * d), p + "w_gate": (i, e), p + "w_up": (i, e),
                     p + "w_down": (e, i)})
    for name, shape in want.items():
        if name not in t:
            raise ModelLoadError(path, f"tensor {name} is missing")
        if tuple(t[name].shape) != shape:
            raise ModelLoadError(path, f"tensor {name} has shape {tuple(t[name].shape)}, expected {shape}")
