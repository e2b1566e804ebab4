"""Small AVX2 CPU kernels, built on first use, for what torch does slowly at decode sizes.

int8_linear:  y[m, n] = scale[n] * sum_k x[m, k] * q[n, k], with q packed by `pack_int8`
              (blocks of 8 output channels, k-major inside a block); each converted weight
              vector serves up to 12 rows of x, so a batch of decodes costs far less than M
              calls, and a prefill chunk runs as fast as the float GEMM
paged_decode_attention: one query per sequence against its K/V read in place through its
              block table (torch would gather every block into a padded copy per layer);
              on 16 lanes where the CPU has AVX512F (head_dim % 16 == 0)
add_rmsnorm:  x += delta (in place, when given); out = x * rsqrt(mean(x^2) + eps) * w
rope_write_kv: RoPE on a step's query and key heads in place, then its K/V into their cache
              slots (float32 or float16), one pass per layer
silu_mul, argmax_rows: the MLP activation and greedy sampling in one pass each
              one call instead of torch's ~6 kernel launches per norm, per layer, per token
              (silu_mul on 16 lanes where the CPU has AVX512-BF16, the same bits)
decode_layers: a decode step's layers, each one call (`DecodeLayers`): the kernels above and
              the GGUF linears in forward's order, without the Python between them

torch's own int8 kernel (`_weight_int8pack_mm`) is slow on CPUs without AVX-512 and wants
bfloat16 activations; this one reads each weight byte once and accumulates in float32. It is
plain C compiled with the system compiler into a shared library and called through ctypes;
it links the libgomp that torch already loaded, so both share one OpenMP thread team.
`load()` returns None (callers fall back to torch) where there is no AVX2/FMA or no compiler.
The C sources live in kernels/ (fused_avx2.c here; gguf_linear.c, built per instruction set,
in gguf_kernels.py).
"""
from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from typing import Callable
from pathlib import Path

import torch

from services.engine.isa import cpu_flags  # noqa: F401 (the kernels' flags, capped by TOKENSERVE_CPU_ISA)
from tokenserve.runtime.logging import get_logger

log = get_logger(component="engine.cpu_kernels")

KERNEL_DIR = Path(__file__).parent / "kernels"  # the C sources, shipped with the package

_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_has_avx2_fma_f16c() -> bool:
    return {"avx2", "fma", "f16c"} <= cpu_flags()


def build(source: str, flags: list[str], cache_dir: Path | None = None) -> Path:
    """Compiles kernels/<source> with `flags` into a shared library (cached by content and
    flags); raises RuntimeError or subprocess errors where it cannot."""
    # the source and the headers it may include (kernels/*.h): a header's change is a new build
    text = "\0".join(p.read_text() for p in [KERNEL_DIR / source, *sorted(KERNEL_DIR.glob("*.h"))])
    digest = hashlib.sha256("\0".join([text, *flags]).encode()).hexdigest()[:16]
    cache_dir = cache_dir or Path.home() / ".cache" / "tokenserve" / "kernels"
    so = cache_dir / f"{Path(source).stem}_{digest}.so"
    if so.is_file():
        return so
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    cache_dir.mkdir(parents=True, exist_ok=True)
    torch_lib = Path(torch.__file__).parent / "lib"
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        out = Path(tmp) / so.name
        # Link torch's own libgomp when it ships one, so there is a single OpenMP runtime.
        gomp = ["-L", str(torch_lib), f"-Wl,-rpath,{torch_lib}"] if (torch_lib / "libgomp.so.1").exists() else []
        cmd = [cc, "-O3", *flags, "-fopenmp", "-shared", "-fPIC", str(KERNEL_DIR / source), "-o", str(out), *gomp, "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        out.replace(so)  # atomic: concurrent builders never see a half-written library
    return so


def load(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built here (then use torch)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if not _cpu_has_avx2_fma_f16c():
        log.info("cpu_kernels_unavailable", reason="cpu lacks avx2, fma or f16c")
        return None
    try:
        so = build("fused_avx2.c", ["-mavx2", "-mfma", "-mf16c"], cache_dir)
        lib = ctypes.CDLL(str(so))
        lib.int8_linear.restype = None
        lib.int8_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        for name in [base + isa for base in ("paged_decode_attention", "paged_decode_attention_f16")
                     for isa in ("", "_avx2", "_avx512")]:  # the first picks by the CPU
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64]
        for name in ("prompt_attention_avx512", "prompt_attention_avx512_f16"):
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 5
                           + [ctypes.c_float, ctypes.c_int64])
        for name in ("silu_mul", "silu_mul_avx2", "silu_mul_avx512"):  # the first picks by the CPU
            getattr(lib, name).restype = None
            getattr(lib, name).argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        lib.fused_allow_avx512bf16.restype = None
        lib.fused_allow_avx512bf16.argtypes = [ctypes.c_int]
        lib.fused_allow_avx512bf16(int("avx512_bf16" in cpu_flags()))
        lib.avx512_allowed = "avx512f" in cpu_flags()  # prompt_attention's kernel (read per layer)
        lib.fused_allow_avx512.restype = None
        lib.fused_allow_avx512.argtypes = [ctypes.c_int]
        lib.fused_allow_avx512(int(lib.avx512_allowed))  # paged_decode_attention's AVX-512 kernel
        lib.argmax_rows.restype = None
        lib.argmax_rows.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        lib.add_rmsnorm.restype = None
        lib.add_rmsnorm.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int]
                                    + [ctypes.c_int64] * 2 + [ctypes.c_float])
        lib.rope_write_kv.restype = None
        lib.rope_write_kv.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] + [ctypes.c_int64] * 4
        lib.decode_layers.restype = ctypes.c_int
        lib.decode_layers.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2
                                      + [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64])
        _lib = lib
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("cpu_kernels_unavailable", reason=f"{type(e).__name__}: {e}"[:300])
    return _lib


PACK_BLOCK = 8  # output channels per packed block (one float vector)
PACK_GROUP = 96  # channels per OpenMP work item (12 blocks); packed weights are padded to it


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: int8 [N, K], scale: float32 [N] -> (packed int8 [Np / 8, K, 8], scale [Np]),
    N zero-padded to Np, a multiple of PACK_GROUP."""
    n, k = q.shape
    np_ = -(-n // PACK_GROUP) * PACK_GROUP
    qp = torch.zeros((np_, k), dtype=torch.int8)
    qp[:n] = q
    sp = torch.zeros(np_, dtype=torch.float32)
    sp[:n] = scale
    return qp.view(np_ // PACK_BLOCK, PACK_BLOCK, k).transpose(1, 2).contiguous(), sp


def unpack_int8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The int8 [N, K] matrix `pack_int8` packed."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]


def int8_linear(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                n: int) -> torch.Tensor:
    """x: float32 [M, K] (made contiguous), packed/scale from `pack_int8` -> [M, n]."""
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty((m, n), dtype=torch.float32)
    lib.int8_linear(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, k)
    return y


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: float32 or bfloat16 [M, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [M, I], of
    the same dtype (bfloat16: computed in float32, rounded once at the end, as torch's
    .to(torch.bfloat16) of the float32 kernel's result)."""
    gate_up = gate_up.contiguous()
    m, i2 = gate_up.shape
    out = torch.empty((m, i2 // 2), dtype=gate_up.dtype)
    lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), m, i2 // 2, _is_bf16(gate_up))
    return out


def _is_bf16(t: torch.Tensor) -> int:
    if t.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"the fused kernels take float32 or bfloat16, not {t.dtype}")
    return int(t.dtype == torch.bfloat16)


def argmax_rows(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """x: float32 [M, V] -> int64 [M], as torch.argmax(x, dim=-1)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
    return out


def add_rmsnorm(lib: ctypes.CDLL, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor,
                eps: float, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x: float32 contiguous [M, K], updated in place to x + delta (delta float32 or bfloat16);
    returns rmsnorm(x) * w, float32 or (out_dtype bfloat16) rounded to bfloat16."""
    m, k = x.shape
    out = torch.empty((m, k), dtype=out_dtype)
    if delta is not None:
        delta = delta.contiguous()
    lib.add_rmsnorm(x.data_ptr(), 0 if delta is None else delta.data_ptr(),
                    0 if delta is None else _is_bf16(delta), w.data_ptr(), out.data_ptr(), _is_bf16(out),
                    m, k, eps)
    return out


def _attention_rows(q: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention kernels' query rows (read in place when each row's heads are contiguous)
    and their output: `out` checked (contiguous, q's shape), or a new float32 tensor."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    elif not out.is_contiguous() or out.shape != q.shape:
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} tensor")
    return q, out


def paged_decode_attention(lib: ctypes.CDLL, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                           tables: torch.Tensor, ctx: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q: float32 [B, H, D], each row's heads contiguous (a view of a step's Q/K/V rows is read
    in place); cache_k/v: float32 or float16, contiguous [num_blocks, bs, Hkv, D]; tables:
    int64 [B, max_nb]; ctx: int64 [B] context lengths (>= 1) -> float32 [B, H, D], written
    into `out` when given (contiguous)."""
    q, out = _attention_rows(q, out)
    b, h, d = q.shape
    _, bs, hkv, _ = cache_k.shape
    fn = lib.paged_decode_attention_f16 if cache_k.dtype == torch.float16 else lib.paged_decode_attention
    fn(q.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), tables.data_ptr(),
       ctx.data_ptr(), out.data_ptr(), b, h, hkv, d, bs, tables.shape[1], scale, q.stride(0))
    return out


PROMPT_ATTENTION_HEAD_DIMS = (32, 64, 128)
PROMPT_ATTENTION_MAX_GROUP = 48  # query heads per KV head (the kernel's 48 query vectors a task)


def prompt_attention_fits(lib: ctypes.CDLL | None, heads: int, kv_heads: int, head_dim: int,
                          cache_dtype: torch.dtype) -> bool:
    """Whether `prompt_attention` serves this model and cache: the kernels loaded where AVX512F
    was among the CPU's flags (TOKENSERVE_CPU_ISA allowing), a head_dim of 32, 64 or 128, at most 48
    query heads per KV head, a float32 or float16 cache."""
    return (lib is not None and getattr(lib, "avx512_allowed", False) and head_dim in PROMPT_ATTENTION_HEAD_DIMS
            and heads % kv_heads == 0 and heads // kv_heads <= PROMPT_ATTENTION_MAX_GROUP
            and cache_dtype in (torch.float32, torch.float16))


def prompt_attention(lib: ctypes.CDLL, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                     tables: torch.Tensor, ctx: torch.Tensor, groups: torch.Tensor, scale: float,
                     out: torch.Tensor) -> torch.Tensor:
    """What paged_decode_attention gives prompt rows, a chunk's rows at a time (fused_avx2.c
    prompt_attention_avx512; where prompt_attention_fits). q, cache_k/v, tables, ctx, out as
    paged_decode_attention takes them; groups: int64 [G, 2] (first row, rows): runs of one
    chunk's consecutive rows, row i's context the first row's + i, their tables alike."""
    q, out = _attention_rows(q, out)
    b, h, d = q.shape
    _, bs, hkv, _ = cache_k.shape
    fn = lib.prompt_attention_avx512_f16 if cache_k.dtype == torch.float16 else lib.prompt_attention_avx512
    fn(q.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), tables.data_ptr(), ctx.data_ptr(),
       groups.data_ptr(), groups.shape[0], out.data_ptr(), h, hkv, d, bs, tables.shape[1], scale, q.stride(0))
    return out


def rope_fits(head_dim: int, cache_dtype: torch.dtype) -> bool:
    """Whether `rope_write_kv` serves this model and cache."""
    return head_dim % 16 == 0 and cache_dtype in (torch.float32, torch.float16)


def rope_write_kv(lib: ctypes.CDLL, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, slots: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """qkv: float32 contiguous [T, (H + 2 Hkv) * D]: its query and key heads rotated in place
    (cos, sin: [P, D], sin's first half negated; positions: int64 [T]), then its keys and
    values written to cache_k/cache_v ([num_blocks, block_size, Hkv, D], float32 or float16)
    at slots (int64 [T])."""
    lib.rope_write_kv(qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                      slots.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(),
                      int(cache_k.dtype == torch.float16), qkv.shape[0], num_heads, num_kv_heads,
                      head_dim)


class _DLLinear(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_void_p), ("fmt", ctypes.c_int64), ("w", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class _DLLayer(ctypes.Structure):
    _fields_ = [("qkv", _DLLinear), ("o", _DLLinear), ("gate_up", _DLLinear), ("down", _DLLinear),
                ("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                ("cache_k", ctypes.c_void_p), ("cache_v", ctypes.c_void_p), ("swiglu", _DLLinear)]


class _DLModel(ctypes.Structure):
    _fields_ = [("layers", ctypes.POINTER(_DLLayer)), ("num_layers", ctypes.c_int64),
                ("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("block_size", ctypes.c_int64), ("cache_f16", ctypes.c_int64),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("eps", ctypes.c_double),
                ("scale", ctypes.c_double), ("prefetch_next", ctypes.c_void_p)]


class DecodeLayers:
    """A decode step's layers in one C call each (kernels/fused_avx2.c `decode_layers`): the
    same kernels forward calls from Python, in the same order, minus the Python between them.
    Built once per KV cache from the layers' norms, their linears' `decode_kernel()` and the
    cache tensors, which must outlive it (it holds their addresses)."""

    def __init__(self, lib: ctypes.CDLL, layers: list, linears: list[tuple], kv_k: list[torch.Tensor],
                 kv_v: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, *, hidden: int,
                 heads: int, kv_heads: int, head_dim: int, eps: float, scale: float,
                 prefetch_next: int | None = None):
        """layers: (attn_norm, ffn_norm) per layer; linears: per layer the four
        `decode_kernel()` tuples (qkv, o, gate_up, down), and optionally a fifth: gate_up's
        `decode_swiglu_kernel()` (None: gate_up then silu_mul); prefetch_next: the address of
        gguf_interleaved.c's gguf_il16_prefetch_next where the Q/K/V linears are that kernel."""
        self.lib, self.num_layers = lib, len(layers)
        self._keep = (layers, kv_k, kv_v, cos, sin)
        arr = (_DLLayer * len(layers))()
        for i, ((attn_norm, ffn_norm), lins) in enumerate(zip(layers, linears)):
            swiglu = lins[4] if len(lins) > 4 and lins[4] is not None else (None, 0, None, 0, 0)
            arr[i] = _DLLayer(*(_DLLinear(*lin) for lin in lins[:4]), attn_norm.data_ptr(), ffn_norm.data_ptr(),
                              kv_k[i].data_ptr(), kv_v[i].data_ptr(), _DLLinear(*swiglu))
        self._layers = arr
        self.cache_ptr = kv_k[0].data_ptr()
        self._model = _DLModel(arr, len(layers), hidden, heads, kv_heads, head_dim, kv_k[0].shape[1],
                             int(kv_k[0].dtype == torch.float16), cos.data_ptr(), sin.data_ptr(), eps, scale,
                             prefetch_next)

    def run(self, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            tables: torch.Tensor, ctx: torch.Tensor,
            between_layers: Callable[[int, int], None] | None = None) -> None:
        """Every layer on the step's T decode rows: x (float32 [T, hidden], the residual)
        updated in place; h (float32 [T, hidden]): the first layer's normed input. positions,
        slots, ctx: int64 [T]; tables: int64 [T, W]. With between_layers, one call a layer and
        between_layers(done, num_layers) after each but the last (as forward calls it)."""
        n = self.num_layers
        for first in range(n) if between_layers is not None else (0,):
            last = first + 1 if between_layers is not None else n
            rc = self.lib.decode_layers(ctypes.byref(self._model), first, last, x.data_ptr(), h.data_ptr(),
                                        x.shape[0], positions.data_ptr(), slots.data_ptr(),
                                        tables.data_ptr(), ctx.data_ptr(), tables.shape[1])
            if rc != 0:
                raise RuntimeError(f"decode_layers: a linear refused its matrix (code {rc})")
            if between_layers is not None and last < n:
                between_layers(last, n)
