"""Llama-family decoder in plain PyTorch over a flat token batch and a paged KV cache.

RMSNorm, RoPE (rotate-half layout, model theta, linear / llama3 scaling or GGUF rope_freqs),
grouped-query attention, SwiGLU, tied or separate output embedding. Q/K/V and gate/up are
fused into one matmul each. Every forward works on all tokens of a step at once, so a batch of
decodes reads each weight once.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from services.engine import attention, cpu_kernels
from services.engine.attention import AttentionMetadata, KVCache, PagedDecode, attend, write_kv
from services.engine.device import is_cuda
from services.engine.gguf_kernels import GGUFWeight
from services.engine.loader import LoadedWeights, ModelConfig
from services.engine.quant import GGUFLinear, make_linear


# Decode attention on CUDA: "auto" (Triton where it imports, else gather), "triton", or
# "gather" (torch over the rows' gathered blocks: the reference). The CPU has its C kernel.
DECODE_ATTENTION = ("auto", "triton", "gather")


class LlamaModel:
    """Weights plus forward(); holds no per-request state (that lives in the KV cache)."""

    def __init__(self, loaded: LoadedWeights, *, dtype: torch.dtype = torch.float32,
                 quantization: str = "none", device: str = "cpu", fused_kernels: bool = True,
                 prefill_bf16: bool = False, decode_bf16: bool = False, decode_i16: bool = False,
                 prefill_i16: bool = False, prefill_i8: bool = False, decode_attention: str = "auto"):
        c = self.config = loaded.config
        t = loaded.tensors
        self.dtype, self.device = dtype, device
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim

        def dense(w: torch.Tensor) -> torch.Tensor:
            return w.to(device=device, dtype=dtype).contiguous()

        def lin(*names: str, prefill: bool = True, int8: bool = True):
            """One linear over the rows of the named weights: their file blocks where the loader
            kept them all in one format (quantization "auto"), else float."""
            blocks = [loaded.quantized.get(n) for n in names]
            fused = GGUFWeight.cat(blocks) if all(b is not None for b in blocks) else None
            if fused is None:
                fused = torch.cat([t[n] if n in t else loaded.quantized[n].dequantize() for n in names])
            return make_linear(fused, quantization=quantization, dtype=dtype, device=device,
                               kernels=fused_kernels, prefill_bf16=prefill_bf16 and prefill,
                               decode_bf16=decode_bf16, decode_i16=decode_i16,
                               prefill_i16=prefill_i16 and prefill, prefill_i8=prefill_i8 and prefill and int8)

        self.embed = dense(t["embed"])  # [V, E]
        # logits are taken for a few rows a step: the head never needs a prefill copy
        self.lm_head = lin("embed" if c.tie_embeddings else "lm_head", prefill=False)
        self.norm = dense(t["norm"])
        self.layers = []
        for i in range(c.num_layers):
            p = f"layers.{i}."
            self.layers.append(_Layer(
                attn_norm=dense(t[p + "attn_norm"]), ffn_norm=dense(t[p + "ffn_norm"]),
                # prompt rows' q, k and v stay int16 where the others take int8 (prefill_i8):
                # q and k meet in the softmax's exponent and k, v are cached for every later
                # token. Greedy tokens of the 6 oracle prompts against float32 on the AVX2-capped
                # Xeon: all four kinds in int8, 2 left them; q, k, v alone, 3 (one at its first
                # token); o, gate/up and down, none
                qkv=lin(p + "wq", p + "wk", p + "wv", int8=False),
                o=lin(p + "wo"),
                gate_up=lin(p + "w_gate", p + "w_up"),
                down=lin(p + "w_down"),
            ))
        self._gguf_layers = all(isinstance(lin, GGUFLinear) for layer in self.layers
                                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        # bfloat16 activations between a bfloat16 step's multiplies (forward); False: float32
        # copies in between, the same numbers (for comparison)
        self.bf16_activations = True
        fusable = dtype == torch.float32 and device == "cpu" and c.hidden_size % 8 == 0
        self.cpu_kernels = cpu_kernels.load() if fusable and fused_kernels else None
        self._paged = _paged_decode(decode_attention, device)
        self.decode_attention = "triton" if self._paged is not None else (
            "cpu-kernel" if self.cpu_kernels is not None else "gather")
        # `_c_layers`: decode steps' layers in C where every layer linear is a GGUF kernel's
        self._c_linears = (self.cpu_kernels is not None and self._gguf_layers and self._paged is None
                           and all(lin.out_dtype == torch.float32 for layer in self.layers
                                   for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)))
        self._c_plan: cpu_kernels.DecodeLayers | None = None
        # the C decode layers have each layer's Q/K/V multiply prefetch its K/V rows for the
        # attention after it (where that multiply is the interleaved kernel); False: not
        self.prefetch_kv = True
        cos, sin = rope_tables(c, t.get("rope_freqs"))
        self.rope_cos = cos.to(device=device, dtype=dtype)  # [max_position, D]
        self.rope_sin = sin.to(device=device, dtype=dtype)  # [max_position, D], first half negated

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache, logit_rows: torch.Tensor,
                between_layers: Callable[[int, int], None] | None = None,
                greedy: bool = False) -> torch.Tensor:
        """input_ids, positions: [T]; logit_rows: [S] rows whose next-token logits are wanted.
        Returns float32 logits [S, V]; with greedy (only where `greedy_head`), int64 [S]: each
        row's argmax token instead, from the lm_head without the logits. between_layers(done,
        num_layers) is called after each layer but the last (the engine may run another, whole
        forward there: this one's state is its locals and its own KV slots)."""
        c = self.config
        t = input_ids.shape[0]
        nq = c.num_heads + c.num_kv_heads  # heads that get RoPE
        fused = self.cpu_kernels is not None and cpu_kernels.rope_fits(c.head_dim, kv.k[0].dtype)
        if not fused:
            cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, D]
            sin = self.rope_sin[positions].unsqueeze(1)
        x = F.embedding(input_ids, self.embed)  # [T, E], residual stream (updated in place)
        p = meta.decode_start  # rows [0, p) are prompt tokens, [p, T) decodes
        # A step of prompt rows multiplied in bfloat16 (GGUFLinear.bf16_step) keeps the
        # activations between its multiplies in bfloat16: the norms and the MLP's activation
        # write the bfloat16 the next multiply would round them to, and read the bfloat16 it
        # returns (no float32 copies in between; the same numbers).
        bf16 = self._bf16_step(t, p)
        h = self._norm(x, None, self.layers[0].attn_norm, bf16)
        c_layers = self._c_layers(kv) if fused and not meta.prefills and not bf16 else None
        if c_layers is not None:  # a decode step: one C call a layer (the same kernels, the same bits)
            c_layers.run(x, h, positions, meta.slots, meta.decode_blocks, meta.decode_ctx, between_layers)
        else:
            for i, layer in enumerate(self.layers):
                qkv = layer.qkv(h, p)  # [T, (H + 2 Hkv) D]
                if fused:  # RoPE in place, K/V into the cache: one pass
                    cpu_kernels.rope_write_kv(self.cpu_kernels, qkv, positions, self.rope_cos, self.rope_sin,
                                              meta.slots, kv.k[i], kv.v[i], c.num_heads, c.num_kv_heads,
                                              c.head_dim)
                    qk = qkv[:, :self.q_size + self.kv_size].view(t, nq, c.head_dim)
                else:
                    qk = qkv[:, :self.q_size + self.kv_size].view(t, nq, c.head_dim)
                    qk = torch.addcmul(qk * cos, qk.roll(c.head_dim // 2, -1), sin)  # RoPE, rotate-half
                q = qk[:, :c.num_heads]
                k = qk[:, c.num_heads:]
                v = qkv[:, self.q_size + self.kv_size:].view(t, c.num_kv_heads, c.head_dim)
                if not fused:
                    write_kv(kv.k[i], kv.v[i], k, v, meta.slots)
                attn = attend(q, k, v, kv.k[i], kv.v[i], meta, self.scale, self.cpu_kernels,
                              self._paged)  # [T, H * D]
                h = self._norm(x, _mm(layer.o, attn, p, bf16), layer.ffn_norm, bf16)
                mlp = _mm(layer.down, self._swiglu(layer.gate_up, h, p, bf16), p, bf16)
                if i + 1 < len(self.layers):
                    h = self._norm(x, mlp, self.layers[i + 1].attn_norm, bf16)
                    if between_layers is not None:
                        between_layers(i + 1, len(self.layers))
                else:
                    x.add_(mlp)
        x = self._norm(x[logit_rows].contiguous(), None, self.norm)
        if greedy:
            return self.lm_head.greedy_rows(x)
        return self.lm_head(x).float()

    @property
    def greedy_head(self) -> bool:
        """Whether forward(greedy=True) can give argmax tokens without logits (the lm_head
        is a GGUF matrix on AMX tiles: GGUFLinear.greedy_rows)."""
        return bool(getattr(self.lm_head, "has_greedy_rows", False))

    def _c_layers(self, kv: KVCache) -> cpu_kernels.DecodeLayers | None:
        """The decode layers in C (`cpu_kernels.DecodeLayers`) where this model runs them: the
        CPU kernels loaded, every layer linear a GGUF kernel, the C attention serving the cache,
        decode rows not sent elsewhere (`decode_attention`); built once per cache."""
        plan = self._c_plan
        if plan is not None and plan.cache_ptr == kv.k[0].data_ptr():
            return plan
        c = self.config
        if not self._c_linears or not attention.kernel_fits(self.cpu_kernels, c.head_dim, kv.k[0].dtype):
            return None
        self._c_plan = cpu_kernels.DecodeLayers(
            self.cpu_kernels, [(layer.attn_norm, layer.ffn_norm) for layer in self.layers],
            [[lin.decode_kernel() for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
             + [layer.gate_up.decode_swiglu_kernel()] for layer in self.layers],
            kv.k, kv.v, self.rope_cos, self.rope_sin, hidden=c.hidden_size, heads=c.num_heads,
            kv_heads=c.num_kv_heads, head_dim=c.head_dim, eps=c.rms_eps, scale=self.scale,
            prefetch_next=self.layers[0].qkv.prefetch_next_kernel() if self.prefetch_kv else None)
        return self._c_plan

    def _bf16_step(self, rows: int, prefill_rows: int) -> bool:
        # every layer linear is built alike: the first one answers for all
        return (self.bf16_activations and self.cpu_kernels is not None and self._gguf_layers
                and self.layers[0].qkv.bf16_step(rows, prefill_rows))

    def _swiglu(self, gate_up, h: torch.Tensor, prefill_rows: int, bf16: bool) -> torch.Tensor:
        """silu(gate) * up of h: in a bfloat16 step one fused multiply where the linear has it
        (GGUFLinear.swiglu_rows: the same bits), else the multiply then silu_mul."""
        if bf16:
            fused = getattr(gate_up, "swiglu_rows", None)
            out = fused(h) if fused is not None else None
            if out is not None:
                return out
        return self._silu_mul(_mm(gate_up, h, prefill_rows, bf16))

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is not None:
            return cpu_kernels.silu_mul(self.cpu_kernels, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _norm(self, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor,
              bf16: bool = False) -> torch.Tensor:
        """x += delta (in place), then RMSNorm(x) * w. One fused call on float32 CPU (bf16:
        the result rounded to bfloat16)."""
        if self.cpu_kernels is not None:
            return cpu_kernels.add_rmsnorm(self.cpu_kernels, x, delta, w, self.config.rms_eps,
                                           torch.bfloat16 if bf16 else torch.float32)
        if delta is not None:
            x.add_(delta)
        return F.rms_norm(x, (self.config.hidden_size,), w, self.config.rms_eps)


def _paged_decode(choice: str, device: str) -> PagedDecode | None:
    if choice not in DECODE_ATTENTION:
        raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {choice!r}")
    if choice == "gather" or not is_cuda(device):
        return None
    try:
        from services.engine import triton_attention  # imports triton: CUDA only
    except ImportError:
        if choice == "triton":
            raise
        return None
    return triton_attention.paged_decode_attention


def _mm(linear, x: torch.Tensor, prefill_rows: int, bf16: bool) -> torch.Tensor:
    """linear(x), its bfloat16 result kept in a bfloat16 step (GGUFLinear only)."""
    return linear(x, prefill_rows, bf16_out=True) if bf16 else linear(x, prefill_rows)


class _Layer:
    __slots__ = ("attn_norm", "ffn_norm", "qkv", "o", "gate_up", "down")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


def rope_tables(c: ModelConfig, rope_freqs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin: [max_position, head_dim] in float32 (rotate-half layout).

    x_rot = x * cos + roll(x, D/2) * sin_signed equals HF's x * cos + rotate_half(x) * sin.
    """
    d = c.head_dim
    # float32 throughout, as transformers computes it, so positions far out round the same way.
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [D/2]
    scaling = c.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_freqs is not None:  # GGUF llama3-style models ship the per-frequency divisors
        inv_freq = inv_freq / rope_freqs.float()
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    pos = torch.arange(c.max_position, dtype=torch.int64).float()
    angles = pos[:, None] * inv_freq[None, :]  # [P, D/2]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)
