"""A GGUF file's own quantized weights, multiplied in their blocks (kernels/gguf_linear.c).

`GGUFWeight` holds one weight matrix exactly as the file stores it: N rows of blocks of one
block format (Q8_0, Q4_0, Q4_1, Q4_K or Q6_K), as raw bytes. `linear(lib, x, w)` computes
x @ w.T in float32, dequantizing each block in registers with the same float32 operations
as the reference dequantizer, so it computes with exactly the numbers in the file; decode
reads 0.5625 (Q4_0, Q4_K), 0.625 (Q4_1) or 0.82 (Q6_K) bytes per weight instead of int8's 1
or float32's 4.

Instruction sets: the C source is built once per ISA this module knows (`ISAS`, best first)
and `load()` returns the best build the CPU runs (AVX-512 where /proc/cpuinfo lists F, BW, VL
and DQ, with AVX512-BF16 also the bfloat16-arithmetic kernel `linear(..., bf16=True)`; else
AVX2/FMA/F16C); None where neither fits or nothing compiles (callers then dequantize once and
multiply with torch).
"""
from __future__ import annotations

import ctypes
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.engine import cpu_kernels, isa
from tokenserve.runtime.logging import get_logger

log = get_logger(component="engine.gguf_kernels")

# block format -> (GGML type id, also the kernel's format code; weights per block; bytes per block)
FORMATS: dict[str, tuple[int, int, int]] = {"Q8_0": (8, 32, 34), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20),
                                            "Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210)}
# ISA name -> (compiler flags, /proc/cpuinfo flags it needs), best first
ISAS: dict[str, tuple[list[str], frozenset[str]]] = {
    "avx512bf16": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16",
                    "-mavx2", "-mfma", "-mf16c"],
                   frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "avx2",
                              "fma", "f16c"})),
    "avx512vnni": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma",
                    "-mf16c"],
                   frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"})),
    "avx512": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
               frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"})),
    "avxvnni": (["-mavx2", "-mfma", "-mf16c", "-mavxvnni"], frozenset({"avx2", "fma", "f16c", "avx_vnni"})),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], frozenset({"avx2", "fma", "f16c"})),
}
# Reproduces the reference dequantizer's rounding: its multiply and add are never fused.
_CFLAGS = ["-ffp-contract=off"]

_libs: dict[str, ctypes.CDLL | None] = {}
_interleaved: list[ctypes.CDLL | None] = []  # loaded once (kernels/gguf_interleaved.c)
_interleaved_amx: list[bool] = []  # whether that build's AMX kernel is enabled
# The AMX build of gguf_interleaved.c: compiler flags and the /proc/cpuinfo flags it needs
AMX_FLAGS = ["-mamx-tile", "-mamx-bf16"]
AMX_CPU_FLAGS = frozenset({"amx_tile", "amx_bf16"})
# Formats kernels/gguf_interleaved.c serves (its rows in groups of 16)
INTERLEAVED_FORMATS = ("Q4_0", "Q4_1", "Q8_0")
# Formats gguf_linear.c's 16-bit-input decode kernel serves (its rows in groups of 8)
I16_FORMATS = ("Q4_0", "Q4_1", "Q8_0")
I8_FORMATS = ("Q4_0", "Q4_1")  # gguf_linear_i8 (the 4-bit ones: unsigned quads)


# Where int16_multiplies_fast() is False, gguf_linear_i16 forms its block sums with float32 FMAs
# from this many input rows on (the same bits)
I16_FLOAT_ROWS = 12


def int16_multiplies_fast(model: tuple[str, int] | None = None) -> bool:
    """Whether this CPU multiplies 16-bit integers (VPMADDWD) faster than float32 (FMA) for the
    same products: not on AMD family 17h (Zen 1, Zen+, Zen 2) or Hygon's 18h (Zen 1), which
    issue at most one 256-bit VPMADDWD a cycle, the products of two 8-lane FMAs (on a Zen 1
    EPYC from 12 rows the integer tiles took 1.3-1.8x float32's time, the float32 tiles
    1.1-1.3x; measured before the integer tiles stopped spilling, and not since). Elsewhere two
    VPMADDWD a cycle beside adds on a third port (Intel since Haswell, Zen 3 on): on a Xeon
    under the AVX2 cap, SmolLM2's matrices at 11 to 1,024 rows 1.1-1.5x faster than float32.
    model: (vendor_id, cpu family), default this CPU's (isa.cpu_model)."""
    vendor, family = isa.cpu_model() if model is None else model
    return not ((vendor == "AuthenticAMD" and family == 0x17) or (vendor == "HygonGenuine" and family == 0x18))


def runnable_isas() -> list[str]:
    """The ISAs of `ISAS` this CPU runs, best first."""
    have = cpu_kernels.cpu_flags()
    return [isa for isa, (_, need) in ISAS.items() if need <= have]


def load(isa: str | None = None, cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The kernel built for `isa` (default: the best this CPU runs), or None where none can be
    built or run here."""
    if isa is None:
        isas = runnable_isas()
        if not isas:
            log.info("gguf_kernels_unavailable", reason="cpu lacks avx2, fma or f16c")
            return None
        isa = isas[0]
    if isa in _libs:
        return _libs[isa]
    lib = None
    try:
        so = cpu_kernels.build("gguf_linear.c", [*ISAS[isa][0], *_CFLAGS], cache_dir)
        lib = ctypes.CDLL(str(so))
        lib.gguf_linear.restype = ctypes.c_int
        lib.gguf_linear.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
        lib.gguf_dequantize.restype = ctypes.c_int
        lib.gguf_dequantize.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        lib.gguf_isa.restype = ctypes.c_char_p
        lib.gguf_pack_i16.restype = lib.gguf_linear_i16.restype = lib.gguf_input_i16.restype = ctypes.c_int
        lib.gguf_pack_i16.argtypes = lib.gguf_dequantize.argtypes
        lib.gguf_linear_i16.argtypes = lib.gguf_linear.argtypes
        lib.gguf_input_i16.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        lib.gguf_linear_i8.restype = lib.gguf_input_i8.restype = ctypes.c_int
        lib.gguf_linear_i8.argtypes = lib.gguf_linear.argtypes
        lib.gguf_input_i8.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        lib.gguf_i16_float_rows.restype = ctypes.c_int64
        lib.gguf_i16_float_rows.argtypes = [ctypes.c_int64]
        # the same bits either way: float32 tiles from 12 rows where integer multiplies are slow
        lib.gguf_i16_float_rows(0 if int16_multiplies_fast() else I16_FLOAT_ROWS)
        if hasattr(lib, "gguf_linear_bf16"):  # the avx512bf16 build
            lib.gguf_linear_bf16.restype = ctypes.c_int
            lib.gguf_linear_bf16.argtypes = lib.gguf_linear.argtypes
            lib.gguf_dequantize_bf16.restype = ctypes.c_int
            lib.gguf_dequantize_bf16.argtypes = lib.gguf_dequantize.argtypes
        log.info("gguf_kernels_loaded", isa=lib.gguf_isa().decode())
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("gguf_kernels_unavailable", isa=isa, reason=f"{type(e).__name__}: {e}"[:300])
        lib = None
    _libs[isa] = lib
    return lib


def load_interleaved(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """kernels/gguf_interleaved.c (decode rows over interleaved Q4_0/Q4_1/Q8_0 blocks, in
    bfloat16 arithmetic), or None where the CPU lacks AVX512-BF16 or nothing compiles. Where
    the CPU (under the ISA cap) also has AMX-BF16, the build carries gguf_linear_il16_amx and
    the tile state is requested from Linux: `interleaved_amx` says whether that worked."""
    if _interleaved:
        return _interleaved[0]
    lib = None
    if "avx512bf16" in runnable_isas():
        amx = AMX_CPU_FLAGS <= cpu_kernels.cpu_flags()
        try:
            flags = [*ISAS["avx512bf16"][0], *(AMX_FLAGS if amx else []), *_CFLAGS]
            lib = ctypes.CDLL(str(cpu_kernels.build("gguf_interleaved.c", flags, cache_dir)))
            lib.gguf_pack_il16.restype = lib.gguf_linear_il16.restype = ctypes.c_int
            lib.gguf_pack_il16.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
            lib.gguf_linear_il16.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
            if amx:
                for name in ("gguf_linear_il16_amx", "gguf_linear_il16_amx_swiglu", "gguf_argmax_il16_amx"):
                    getattr(lib, name).restype = ctypes.c_int
                    getattr(lib, name).argtypes = lib.gguf_linear_il16.argtypes
                lib.bf16_pack_tiles.restype = lib.bf16_gemm_amx.restype = ctypes.c_int
                lib.bf16_pack_tiles.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
                lib.bf16_gemm_amx.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
                lib.bf16_gemm_amx_swiglu.restype = ctypes.c_int
                lib.bf16_gemm_amx_swiglu.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
                amx = lib.gguf_il16_amx_init() == 0
                if not amx:
                    log.warning("gguf_interleaved_amx_unavailable", reason="Linux refused the AMX tile state")
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("gguf_interleaved_unavailable", reason=f"{type(e).__name__}: {e}"[:300])
            lib, amx = None, False
        _interleaved_amx.append(amx)
        log.info("gguf_interleaved_loaded", amx=amx)
    _interleaved.append(lib)
    return lib


def interleaved_amx(lib: ctypes.CDLL | None) -> bool:
    """Whether `lib` (load_interleaved's) multiplies decode rows with AMX tiles
    (gguf_linear_il16_amx) rather than VDPBF16PS (gguf_linear_il16): the same arithmetic on the
    file's exact weights, each block's products summed in another order."""
    return lib is not None and bool(_interleaved_amx) and _interleaved_amx[0]


def interleaved_kernel(lib: ctypes.CDLL, amx: bool):
    """The entry point decode rows take in `lib`: gguf_linear_il16_amx with `amx`, else
    gguf_linear_il16 (one signature)."""
    return lib.gguf_linear_il16_amx if amx else lib.gguf_linear_il16


@dataclass(frozen=True)
class GGUFWeight:
    """One [N, K] weight matrix in its file blocks: `blocks` is uint8 [N, K / block weights *
    block bytes]."""

    kind: str
    blocks: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self):
        n, k = self.shape
        if self.kind not in FORMATS:
            raise ValueError(f"block format {self.kind} has no kernel (have {', '.join(FORMATS)})")
        _, per, size = FORMATS[self.kind]
        if k % per or tuple(self.blocks.shape) != (n, k // per * size):
            raise ValueError(f"{self.kind} blocks {tuple(self.blocks.shape)} do not hold a {n}x{k} matrix")

    @staticmethod
    def cat(parts: list["GGUFWeight"]) -> "GGUFWeight | None":
        """The rows of `parts` stacked, or None when their formats or widths differ."""
        if len({(p.kind, p.shape[1]) for p in parts}) != 1:
            return None
        return GGUFWeight(parts[0].kind, torch.cat([p.blocks for p in parts]).contiguous(),
                          (sum(p.shape[0] for p in parts), parts[0].shape[1]))

    def rows(self, index: torch.Tensor) -> "GGUFWeight":
        """The rows `index` selects, in that order (row permutations are exact on blocks)."""
        return GGUFWeight(self.kind, self.blocks[index].contiguous(), (len(index), self.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], by the gguf package's reference dequantizer."""
        import gguf

        qtype = gguf.GGMLQuantizationType(FORMATS[self.kind][0])
        array = gguf.quants.dequantize(self.blocks.numpy(), qtype)
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).reshape(self.shape)


def has_bfloat16(lib: ctypes.CDLL | None) -> bool:
    """Whether `lib` is a build with the bfloat16-arithmetic kernel (`linear(..., bf16=True)`)."""
    return lib is not None and hasattr(lib, "gguf_linear_bf16")


def linear(lib: ctypes.CDLL, x: torch.Tensor, w: GGUFWeight, bf16: bool = False) -> torch.Tensor:
    """x: float32 [M, K] (made contiguous) -> x @ w.T, float32 [M, N]. bf16: x and the weights
    rounded to bfloat16, products summed in float32 (a build where `has_bfloat16`)."""
    x = x.contiguous()
    n, k = w.shape
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    fn = lib.gguf_linear_bf16 if bf16 else lib.gguf_linear
    rc = fn(FORMATS[w.kind][0], x.data_ptr(), w.blocks.data_ptr(), y.data_ptr(), x.shape[0], n, k)
    if rc != 0:
        raise ValueError(f"gguf_linear rejected a {w.kind} {n}x{k} matrix")
    return y


def dequantize(lib: ctypes.CDLL, w: GGUFWeight) -> torch.Tensor:
    """float32 [N, K] by the kernel's own in-register dequantization (tests compare it with
    `GGUFWeight.dequantize`)."""
    out = torch.empty(w.shape, dtype=torch.float32)
    if lib.gguf_dequantize(FORMATS[w.kind][0], w.blocks.data_ptr(), out.data_ptr(), *w.shape) != 0:
        raise ValueError(f"gguf_dequantize rejected a {w.kind} {w.shape} matrix")
    return out


def dequantize_bf16(lib: ctypes.CDLL, w: GGUFWeight) -> torch.Tensor:
    """bfloat16 [N, K]: the weights as `linear(..., bf16=True)` multiplies them."""
    out = torch.empty(w.shape, dtype=torch.bfloat16)
    if lib.gguf_dequantize_bf16(FORMATS[w.kind][0], w.blocks.data_ptr(), out.data_ptr(), *w.shape) != 0:
        raise ValueError(f"gguf_dequantize_bf16 rejected a {w.kind} {w.shape} matrix")
    return out


def pack_interleaved(lib: ctypes.CDLL, w: GGUFWeight) -> torch.Tensor | None:
    """w's blocks interleaved 16 rows at a time for `linear_interleaved` (uint8, w's size), or
    None where its format or row count does not fit (INTERLEAVED_FORMATS, rows a multiple of 16)."""
    if w.kind not in INTERLEAVED_FORMATS or w.shape[0] % 16:
        return None
    out = torch.empty_like(w.blocks)
    if lib.gguf_pack_il16(FORMATS[w.kind][0], w.blocks.data_ptr(), out.data_ptr(), *w.shape) != 0:
        raise ValueError(f"gguf_pack_il16 rejected a {w.kind} {w.shape} matrix")
    return out


def linear_interleaved_swiglu(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for w a [gate; up] matrix (N rows, N % 32 == 0) on AMX
    tiles (where interleaved_amx(lib)): float32 [M, N / 2], the same bits as
    `linear_interleaved(..., amx=True)` then cpu_kernels.silu_mul."""
    x = x.contiguous()
    n, k = w.shape
    y = torch.empty((x.shape[0], n // 2), dtype=torch.float32)
    if lib.gguf_linear_il16_amx_swiglu(FORMATS[w.kind][0], x.data_ptr(), packed.data_ptr(), y.data_ptr(),
                                       x.shape[0], n, k) != 0:
        raise ValueError(f"gguf_linear_il16_amx_swiglu rejected a {w.kind} {n}x{k} matrix")
    return y


def argmax_interleaved(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """Each row's argmax over x @ w.T on AMX tiles (where interleaved_amx(lib)), without the
    product: int64 [M], the index cpu_kernels.argmax_rows gives over
    `linear_interleaved(..., amx=True)` (the same sums; the first of equal values, a NaN the
    largest)."""
    x = x.contiguous()
    n, k = w.shape
    ids = torch.empty(x.shape[0], dtype=torch.int64)
    if lib.gguf_argmax_il16_amx(FORMATS[w.kind][0], x.data_ptr(), packed.data_ptr(), ids.data_ptr(),
                                x.shape[0], n, k) != 0:
        raise ValueError(f"gguf_argmax_il16_amx rejected a {w.kind} {n}x{k} matrix")
    return ids


def pack_i16(lib: ctypes.CDLL, w: GGUFWeight) -> torch.Tensor | None:
    """w's blocks laid out for `linear_i16` (gguf_pack_i16: uint8, w's size), or None where its
    format or row count does not fit (I16_FORMATS, rows a multiple of 8)."""
    if w.kind not in I16_FORMATS or w.shape[0] % 8:
        return None
    out = torch.empty_like(w.blocks)
    if lib.gguf_pack_i16(FORMATS[w.kind][0], w.blocks.data_ptr(), out.data_ptr(), *w.shape) != 0:
        raise ValueError(f"gguf_pack_i16 rejected a {w.kind} {w.shape} matrix")
    return out


def linear_i16(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """x: float32 [M, K] (made contiguous) -> x @ w.T, float32 [M, N], with `packed` =
    pack_i16(lib, w): the file's exact weights, x rounded per block of 32 to fixed point (15 bits
    of the block's largest, Q8_0 12: `input_i16`), each block's products summed exactly."""
    return _packed_linear(lib, "gguf_linear_i16", x, packed, w)


def linear_i8(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """x: float32 [M, K] (made contiguous) -> x @ w.T, float32 [M, N], for a Q4_0 / Q4_1 matrix
    (I8_FORMATS) with `packed` = pack_i16(lib, w): the file's exact weights, x rounded per block
    of 32 to int8 as llama.cpp rounds its Q8_0 activations (`input_i8`), each block's products
    summed exactly."""
    return _packed_linear(lib, "gguf_linear_i8", x, packed, w)


def _packed_linear(lib: ctypes.CDLL, name: str, x: torch.Tensor, packed: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """x @ w.T by the C kernel `name` over pack_i16's layout: float32 [M, N]."""
    x = x.contiguous()
    n, k = w.shape
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    rc = getattr(lib, name)(FORMATS[w.kind][0], x.data_ptr(), packed.data_ptr(), y.data_ptr(), x.shape[0], n, k)
    if rc != 0:
        raise (MemoryError if rc == -2 else ValueError)(f"{name} rejected a {w.kind} {n}x{k} matrix")
    return y


def input_i8(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """x (float32 [M, K], K a multiple of 32) as `linear_i8` rounds it: float32."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if lib.gguf_input_i8(x.data_ptr(), out.data_ptr(), *x.shape) != 0:
        raise ValueError(f"gguf_input_i8 rejected a {tuple(x.shape)} input")
    return out


def input_i16(lib: ctypes.CDLL, x: torch.Tensor, kind: str) -> torch.Tensor:
    """x (float32 [M, K], K a multiple of 32) as `linear_i16` rounds it for a `kind` matrix
    (I16_FORMATS): float32."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if lib.gguf_input_i16(FORMATS[kind][0], x.data_ptr(), out.data_ptr(), *x.shape) != 0:
        raise ValueError(f"gguf_input_i16 rejected a {tuple(x.shape)} input")
    return out


def pack_bf16_tiles(lib: ctypes.CDLL, w: torch.Tensor) -> torch.Tensor | None:
    """w: bfloat16 [N, K] -> its B tiles for `gemm_bf16_amx` (bf16_pack_tiles; w's size), or None
    where N is not a multiple of 16 or K of 32."""
    n, k = w.shape
    if n % 16 or k % 32:
        return None
    w = w.contiguous()
    out = torch.empty(n * k, dtype=torch.bfloat16)
    if lib.bf16_pack_tiles(w.data_ptr(), out.data_ptr(), n, k) != 0:
        raise ValueError(f"bf16_pack_tiles rejected a {n}x{k} matrix")
    return out


def gemm_bf16_amx(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, n: int,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x @ w.T on AMX tiles, packed = pack_bf16_tiles(lib, w): x bfloat16 [M, K] (made
    contiguous), products summed in float32, y [M, n] in float32 or bfloat16 (rounded to
    nearest even). A row's result does not depend on M or the other rows."""
    x = x.contiguous()
    y = torch.empty((x.shape[0], n), dtype=out_dtype)
    if out_dtype not in (torch.float32, torch.bfloat16) or lib.bf16_gemm_amx(
            x.data_ptr(), packed.data_ptr(), y.data_ptr(), x.shape[0], n, x.shape[1],
            int(out_dtype == torch.bfloat16)) != 0:
        raise ValueError(f"bf16_gemm_amx rejected a {n}x{x.shape[1]} matrix into {out_dtype}")
    return y


def gemm_bf16_amx_swiglu(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for packed = pack_bf16_tiles(lib, [gate; up]) (n rows, a
    multiple of 32): x bfloat16 [M, K] -> bfloat16 [M, n / 2], the same bits as
    silu_mul(gemm_bf16_amx(lib, x, packed, n, torch.bfloat16)) without the [M, n] output."""
    x = x.contiguous()
    y = torch.empty((x.shape[0], n // 2), dtype=torch.bfloat16)
    if lib.bf16_gemm_amx_swiglu(x.data_ptr(), packed.data_ptr(), y.data_ptr(), x.shape[0], n, x.shape[1]) != 0:
        raise ValueError(f"bf16_gemm_amx_swiglu rejected a {n}x{x.shape[1]} matrix")
    return y


def linear_interleaved(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, w: GGUFWeight,
                       amx: bool = False) -> torch.Tensor:
    """x: float32 [M, K] (made contiguous) -> x @ w.T, float32 [M, N], with `packed` =
    pack_interleaved(lib, w): the file's exact weights, x rounded to bfloat16, float32 sums;
    with `amx` (where interleaved_amx(lib)) on AMX tiles."""
    x = x.contiguous()
    n, k = w.shape
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    fn = interleaved_kernel(lib, amx)
    if fn(FORMATS[w.kind][0], x.data_ptr(), packed.data_ptr(), y.data_ptr(), x.shape[0], n, k) != 0:
        raise ValueError(f"gguf_linear_il16{'_amx' if amx else ''} rejected a {w.kind} {n}x{k} matrix")
    return y
