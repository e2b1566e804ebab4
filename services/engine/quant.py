"""Linear layers: the model file's own quantized blocks, dense (float32 / bfloat16) or
weight-only int8 (per-output-channel scales).

`make_linear(w)` returns a callable x [T, in] -> [T, out]; the model never looks inside.

Quantization modes:
  auto  the default: a GGUF file's own blocks where gguf_kernels has a kernel for their format
        (computing with exactly the file's numbers); other weights (float tensors, formats
        without a kernel, Hugging Face folders) as int8. Without the C kernels (no AVX2, no
        compiler) the blocks are dequantized once and multiplied by torch in float32.
  none  dense weights in the model dtype (float32: the bit-faithful `--exact` mode)
  int8  every weight re-quantized to per-channel int8

Prefill (`prefill_dtype`): a step's prompt rows are compute-bound, its decode rows read the
weights once for the whole batch. Where the CPU multiplies bfloat16 natively (AMX or
AVX512-BF16), a GGUF linear also keeps its weights as bfloat16 (the file's numbers, rounded to
bfloat16: 2 bytes a weight more) and multiplies a step's prompt rows with them when there are at
least PREFILL_MIN_ROWS; decode rows always use the file's blocks. Measured on a 2-core AVX-512
AMX Xeon, SmolLM2's 3072x576 gate/up matrix: 1000 rows 27 ms on the blocks, 2.1 ms in bfloat16;
32 rows 0.69 vs 0.38 ms. The bfloat16 copy is laid out once in oneDNN's own format
(`_bf16_prepacked`) instead of handed to F.linear as a plain matrix each call (2-core Zen 4:
a layer's four GEMMs at 1024 rows 17.8 -> 17.2 ms, 32 rows of gate/up 341 -> 277 us; a
16 x 64-token prefill 654 -> 624 ms; bit-identical results). Where the CPU has AMX-BF16, the copy is
laid out as AMX tiles instead and multiplied by gguf_interleaved.c's bf16_gemm_amx (float32
sums rounded to bfloat16 as oneDNN's are, a row's result independent of the batch):
a whole 16 x 64-token prefill on a 2-core AMX Xeon, two engines in one process taking turns,
0.79-0.94x oneDNN's time per turn over six runs (e.g. 337 -> 263 ms); 64 x 64: 0.95-0.99x.

Decode (`decode_dtype`): every other row is multiplied on the file's blocks; where their kernels
have an AVX512-BF16 build ("auto"), in bfloat16 arithmetic: Q4_0, Q4_1 and Q8_0 matrices with
rows in sixteens by kernels/gguf_interleaved.c (interleaved 16 rows at a time at load; the
file's exact weights, the input rounded to bfloat16, the scales applied per block), the rest
by gguf_linear.c's bfloat16 kernel (each weight rounded to bfloat16). All linears of a SmolLM2
step, 2-core Zen 4: one row 7.1 ms (float32 arithmetic) -> 4.4 ms, 16 rows 30.6 -> 13.2 ms.
Where the CPU also has AMX-BF16, those interleaved matrices are multiplied on AMX tiles
instead (gguf_linear_il16_amx: the same exact weights and arithmetic, a block's products
summed in the tile's order; all linears of a SmolLM2 step on a 2-core AMX Xeon, in one process:
one row 7.7 vs 6.7 ms, 2 rows 7.9 vs 8.6, 8 rows 7.4 vs 18.5, 32 rows 21.6 vs 73.3, 128 rows 65
vs 309).
Where there is no AVX512-BF16 build ("auto" on AVX2 CPUs, or "int16"), the decode rows of
Q4_0, Q4_1 and Q8_0 matrices with rows in eights take gguf_linear.c's gguf_linear_i16: the
file's exact weights, the input rounded per block of 32 to fixed point (15 bits of the block's
largest, Q8_0 12, where bfloat16 keeps 8 of each number), each block's products summed exactly
(laid out 8 rows at a time at load, a second copy the size of the blocks). SmolLM2's 3072x576
Q4_1 matrix on a 2-core AMD EPYC (Zen 1) at one row: 233 -> 84 us; from 12 rows (the same bits
from float32 FMAs) 1.12-1.3x float32's time. On a 2-core AMX Xeon under the AVX2 cap: one row
2.4x faster than float32, 2 to 8 rows 1.9-2.1x, 11 to 1,024 rows 1.1-1.5x. So prompt rows
there take it as well ("auto": `prefill_in_int16`, where the decode rows do, on the AVX2 build,
except on AMD Zen 1/2, whose integer multiplies are slow: there they stay float32 on the
blocks): a 128-token prompt in 0.92x float32's time there, a 1,000-token one 0.94x (attention
and the rest unchanged).
"int8" (opt-in, never "auto"): Q4_0/Q4_1 prompt rows of the o, gate/up and down linears take
gguf_linear_i8 instead: the same packed blocks, the input rounded per block of 32 to int8 as
llama.cpp rounds its activations (X = round(x * 127 / max|x|)), twice the products per integer
instruction (VPMADDUBSW, or VPDPBUSD with AVX-VNNI / AVX512-VNNI). SmolLM2's 3072x576 / 576x1536
Q4_1 matrices at 64-1,024 rows on the AMX Xeon capped at AVX2: 209-214 / 179-192 GMAC/s
against the 16-bit kernel's 124-127 / 121-124 (avxvnni 249-257 / 209-225 vs 146-150 /
136-144); a 16 x 64-token prefill 1.06 s -> 0.72 s. q, k and v stay 16-bit: q and k meet in the
softmax's exponent and k, v are cached for every later token (greedy tokens of the 6 oracle
prompts: with all four kinds in int8, 2 left float32's; q, k, v alone, 3, one at its first
token; the other three kinds, none). The cost is measured
(bench/engine_agreement.py, prefill logits at 24 points of the oracle prompts against float32):
KL 1.0e-3 where the 16-bit input gives 1.1e-6 and the AMX default's bfloat16 prompt rows 1.9e-4;
the largest logit difference at a point 0.47 in the median (16-bit 0.013, bfloat16 0.16).
Either way a row's result does not depend on the rest of the batch, so speculative and plain
greedy decoding give the same tokens. Greedy agreement with the float32 reference:
bench/engine_agreement.py and bench/engine_cpu.py.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from services.engine import cpu_kernels, gguf_kernels
from services.engine.config import DECODE_DTYPES, PREFILL_DTYPES
from services.engine.gguf_kernels import GGUFWeight

QUANTIZATIONS = ("auto", "none", "int8")
# Fewer prompt rows than this in a step: the blocks' kernel (the bfloat16 copy wins from ~32 on).
PREFILL_MIN_ROWS = 32


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX or AVX512-BF16)."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_kernels.cpu_flags())


def prefill_in_bfloat16(prefill_dtype: str, device: str) -> bool:
    if prefill_dtype not in PREFILL_DTYPES:
        raise ValueError(f"prefill_dtype must be one of {PREFILL_DTYPES}, got {prefill_dtype!r}")
    if prefill_dtype == "auto":
        return device == "cpu" and native_bfloat16()
    return prefill_dtype == "bfloat16"


def _int16_kernels(option: str, value: str, allowed: tuple[str, ...], device: str):
    """The GGUF kernels where `option` (prefill_dtype, decode_dtype) = `value` may take the
    16-bit-input kernel ("int16" or "auto" on the CPU), else None; ValueError for a value not in
    `allowed`, or for "int16" where the kernels cannot be built here."""
    if value not in allowed:
        raise ValueError(f"{option} must be one of {allowed}, got {value!r}")
    if value in ("float32", "bfloat16") or device != "cpu":
        return None
    lib = gguf_kernels.load()
    if value in ("int16", "int8") and lib is None:
        raise ValueError(f"{option} {value} needs a CPU with AVX2, FMA and F16C and a C compiler"
                         " (the GGUF kernels); use auto or float32")
    return lib


def prefill_in_int16(prefill_dtype: str, device: str, decode_int16: bool = True) -> bool:
    """Whether prompt rows take the 16-bit-input kernel (gguf_linear_i16), or with
    `prefill_in_int8` the 8-bit one where a matrix's format has it: prefill_dtype "int16" or
    "int8", or "auto" where the decode rows do (`decode_int16`), the CPU has no native
    bfloat16 and its integer multiplies are the faster (gguf_kernels.int16_multiplies_fast;
    an AVX-512 build's 64-byte integer tiles beat its 16-lane float32 too: SmolLM2's matrices
    at 64 to 1,024 rows 1.15-1.25x, with AVX512-VNNI 1.5-1.65x); raises ValueError for "int16"
    where the kernels cannot be built here."""
    lib = _int16_kernels("prefill_dtype", prefill_dtype, PREFILL_DTYPES, device)
    if lib is None or prefill_dtype in ("int16", "int8"):
        return lib is not None
    return decode_int16 and not native_bfloat16() and gguf_kernels.int16_multiplies_fast()


def prefill_in_int8(prefill_dtype: str, device: str) -> bool:
    """Whether Q4_0/Q4_1 prompt rows take the 8-bit-input kernel (gguf_linear_i8): only where
    asked for (prefill_dtype "int8": llama.cpp's rounding of its activations, a quality loss
    "auto" does not take; see the module docstring); raises ValueError where the kernels cannot
    be built here."""
    return prefill_dtype == "int8" and prefill_in_int16(prefill_dtype, device)


def decode_in_int16(decode_dtype: str, device: str) -> bool:
    """Whether the GGUF blocks' decode rows take the 16-bit-input kernel (gguf_linear_i16):
    decode_dtype "int16", or "auto" where there is no bfloat16 build for this CPU; raises
    ValueError for "int16" where the kernels cannot be built here."""
    lib = _int16_kernels("decode_dtype", decode_dtype, DECODE_DTYPES, device)
    return lib is not None and (decode_dtype == "int16" or not gguf_kernels.has_bfloat16(lib))


def decode_in_bfloat16(decode_dtype: str, device: str) -> bool:
    """Whether the GGUF blocks' kernel multiplies in bfloat16 (decode_dtype "auto": where it has
    a build for this CPU); raises ValueError for "bfloat16" where it has none."""
    if decode_dtype not in DECODE_DTYPES:
        raise ValueError(f"decode_dtype must be one of {DECODE_DTYPES}, got {decode_dtype!r}")
    if decode_dtype in ("float32", "int16") or device != "cpu":
        return False
    here = gguf_kernels.has_bfloat16(gguf_kernels.load())
    if decode_dtype == "bfloat16" and not here:
        raise ValueError("decode_dtype bfloat16 needs a CPU with AVX512-BF16 and a C compiler"
                         " (the GGUF kernels' avx512bf16 build); use auto or float32")
    return here


class DenseLinear:
    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [out, in]

    def __call__(self, x: torch.Tensor, prefill_rows: int = 0) -> torch.Tensor:
        return F.linear(x, self.weight)


class Int8Linear:
    """Symmetric int8 weights, one float32 scale per output row: w ~= q * scale[:, None].

    With the AVX2 kernel (cpu_kernels.int8_linear) every call, decode batch or prefill chunk,
    reads the packed int8 weights (the only copy kept): 1 byte per weight, and a row's result
    bit-identical whatever else is in the batch. Without it (no AVX2, no compiler, not a CPU
    tensor): dequantize per call and use the float GEMM.
    """

    __slots__ = ("scale", "out_dtype", "out_features", "_qweight", "_packed", "_packed_scale", "_lib")

    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype, kernels: bool = True):
        w = weight.float()
        self.out_features = w.shape[0]
        self.scale = (w.abs().amax(dim=1).clamp(min=1e-8) / 127.0).contiguous()  # [out]
        q = torch.round(w / self.scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.out_dtype = out_dtype
        self._lib = cpu_kernels.load() if q.device.type == "cpu" and kernels else None
        self._qweight = self._packed = self._packed_scale = None
        if self._lib is not None:
            self._packed, self._packed_scale = cpu_kernels.pack_int8(q, self.scale)
        else:
            self._qweight = q

    @property
    def qweight(self) -> torch.Tensor:
        """The int8 [out, in] matrix."""
        if self._packed is not None:
            return cpu_kernels.unpack_int8(self._packed, self.out_features)
        return self._qweight

    def __call__(self, x: torch.Tensor, prefill_rows: int = 0) -> torch.Tensor:
        if self._lib is not None:
            y = cpu_kernels.int8_linear(self._lib, x.float(), self._packed, self._packed_scale,
                                        self.out_features)
            return y if self.out_dtype == torch.float32 else y.to(self.out_dtype)
        w = self._qweight.to(x.dtype)
        return F.linear(x, w) * self.scale.to(x.dtype)


class GGUFLinear:
    """The file's own blocks, multiplied by gguf_kernels (dequantized in registers; in bfloat16
    arithmetic with `decode_bf16`); with `prefill_bf16`, a bfloat16 copy for a step's prompt
    rows (see the module docstring)."""

    __slots__ = ("weight", "out_dtype", "_lib", "_bf16", "_gemm", "_decode_bf16", "_il", "_amx", "_interleaved",
                 "_i16", "_decode_i16", "_prefill_i16", "_prefill_i8")

    def __init__(self, weight: GGUFWeight, out_dtype: torch.dtype, lib, prefill_bf16: bool = False,
                 decode_bf16: bool = False, decode_i16: bool = False, prefill_i16: bool = False,
                 prefill_i8: bool = False):
        self.weight, self.out_dtype, self._lib, self._decode_bf16 = weight, out_dtype, lib, decode_bf16
        # the bfloat16 copy for prompt rows: AMX tiles (_gemm: the library that multiplies them)
        # or oneDNN's layout
        self._bf16, self._gemm = None, None
        if prefill_bf16:
            w16 = gguf_kernels.dequantize(lib, weight).to(torch.bfloat16).contiguous()
            tiles = gguf_kernels.load_interleaved()
            if gguf_kernels.interleaved_amx(tiles):
                self._bf16 = gguf_kernels.pack_bf16_tiles(tiles, w16)
                self._gemm = tiles if self._bf16 is not None else None
            if self._bf16 is None:
                self._bf16 = _bf16_prepacked(w16)
        # bfloat16 decode rows of Q4_0/Q4_1/Q8_0: the interleaved kernel, on the exact weights
        self._il = gguf_kernels.load_interleaved() if decode_bf16 else None
        self._amx = gguf_kernels.interleaved_amx(self._il)  # the same arithmetic, on AMX tiles
        self._interleaved = gguf_kernels.pack_interleaved(self._il, weight) if self._il is not None else None
        # decode rows (with prefill_i16 also prompt rows) of Q4_0/Q4_1/Q8_0 with the input in
        # 16-bit fixed point (gguf_linear_i16), on the exact weights laid out 8 rows at a time
        decode_i16 = decode_i16 and not decode_bf16
        self._i16 = gguf_kernels.pack_i16(lib, weight) if decode_i16 or prefill_i16 or prefill_i8 else None
        self._decode_i16 = decode_i16 and self._i16 is not None
        self._prefill_i16 = prefill_i16 and self._i16 is not None and self._bf16 is None
        # prompt rows of Q4_0/Q4_1 with the input in int8 (gguf_linear_i8, the same packed blocks)
        self._prefill_i8 = (prefill_i8 and self._i16 is not None and self._bf16 is None
                            and weight.kind in gguf_kernels.I8_FORMATS)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T on the file's blocks for decode rows (and short prompt chunks, except beside
        16-bit-input decode rows: `_prompt_path`)."""
        if self._interleaved is not None:
            return gguf_kernels.linear_interleaved(self._il, x, self._interleaved, self.weight, self._amx)
        if self._decode_i16:
            return self._int16_rows(x)
        return self._file_blocks(x)

    def _int16_rows(self, x: torch.Tensor) -> torch.Tensor:
        return gguf_kernels.linear_i16(self._lib, x, self._i16, self.weight)

    def _int8_rows(self, x: torch.Tensor) -> torch.Tensor:
        return gguf_kernels.linear_i8(self._lib, x, self._i16, self.weight)

    def _prompt_path(self, rows: int):
        """What multiplies a step's `rows` prompt rows: the bfloat16 copy (from PREFILL_MIN_ROWS
        rows), the 8-bit-input kernel (prefill_i8), the 16-bit-input one (prefill_i16), float32
        on the file's blocks beside 16-bit-input decode rows, else the decode rows' own path
        (`_blocks`)."""
        if self._bf16 is not None and rows >= PREFILL_MIN_ROWS:
            return self._prompt_rows
        if self._prefill_i8:
            return self._int8_rows
        if self._prefill_i16:
            return self._blocks if self._decode_i16 else self._int16_rows
        return self._file_blocks if self._decode_i16 else self._blocks

    def _file_blocks(self, x: torch.Tensor) -> torch.Tensor:
        return gguf_kernels.linear(self._lib, x, self.weight, self._decode_bf16)

    def decode_kernel(self) -> tuple[int, int, int, int, int]:
        """What `_blocks` calls, for C callers (cpu_kernels.decode_layers): (the kernel's
        address, format code, weights pointer, N, K)."""
        n, k = self.weight.shape
        code = gguf_kernels.FORMATS[self.weight.kind][0]
        if self._interleaved is not None:
            fn, w = gguf_kernels.interleaved_kernel(self._il, self._amx), self._interleaved
        elif self._decode_i16:
            fn, w = self._lib.gguf_linear_i16, self._i16
        else:
            fn = self._lib.gguf_linear_bf16 if self._decode_bf16 else self._lib.gguf_linear
            w = self.weight.blocks
        return ctypes.cast(fn, ctypes.c_void_p).value, code, w.data_ptr(), n, k

    def decode_swiglu_kernel(self) -> tuple[int, int, int, int, int] | None:
        """For a [gate; up] linear: the kernel that gives decode rows silu(gate) * up in one
        pass (gguf_linear_il16_amx_swiglu: the same bits as `decode_kernel()` then silu_mul),
        as decode_kernel's tuple; None where its rows do not take AMX tiles."""
        n, k = self.weight.shape
        if self._interleaved is None or not self._amx or n % 32:
            return None
        fn = ctypes.cast(self._il.gguf_linear_il16_amx_swiglu, ctypes.c_void_p).value
        return fn, gguf_kernels.FORMATS[self.weight.kind][0], self._interleaved.data_ptr(), n, k

    @property
    def has_greedy_rows(self) -> bool:
        """Whether `greedy_rows` works here: decode rows on AMX tiles, float32 output."""
        return self._interleaved is not None and self._amx and self.out_dtype == torch.float32

    def greedy_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax over x @ w.T, int64 [T], without the product (where
        `has_greedy_rows`; gguf_kernels.argmax_interleaved): the token argmax over __call__'s
        output gives, that output never written. SmolLM2's lm_head on the 2-core AMX Xeon,
        multiply + argmax_rows against this: 64 rows 4.5 -> 3.5 ms, 16 rows 1.5 -> 1.2."""
        if not self.has_greedy_rows:
            raise ValueError("greedy_rows needs the interleaved blocks on AMX tiles")
        return gguf_kernels.argmax_interleaved(self._il, x.float(), self._interleaved, self.weight)

    @property
    def decode_row_tile(self) -> int:
        """Decode rows multiplied as one unit: 16 on AMX tiles (up to 16 rows cost alike), else
        0 (each row costs its own)."""
        return 16 if self._interleaved is not None and self._amx else 0

    def prefetch_next_kernel(self) -> int | None:
        """Where decode rows go through the interleaved kernel (VDPBF16PS): the address of its
        gguf_il16_prefetch_next (rows it prefetches during its next call), else None (the AMX
        kernel prefetches none)."""
        if self._interleaved is None or self._amx:
            return None
        return ctypes.cast(self._il.gguf_il16_prefetch_next, ctypes.c_void_p).value

    def bf16_step(self, rows: int, prefill_rows: int) -> bool:
        """Whether a step of `rows` rows, the first `prefill_rows` of them prompt tokens, is
        multiplied in bfloat16 whole (then __call__ takes and, asked to, returns bfloat16)."""
        return self._bf16 is not None and prefill_rows == rows and rows >= PREFILL_MIN_ROWS

    def __call__(self, x: torch.Tensor, prefill_rows: int = 0, bf16_out: bool = False) -> torch.Tensor:
        """x: [T, in]; its first `prefill_rows` rows are prompt tokens, the rest decodes. In a
        bfloat16 step (`bf16_step`) x may be bfloat16 already and, with bf16_out, y stays the
        bfloat16 the multiply rounded it to (the same numbers a float32 y widens exactly)."""
        if self.bf16_step(x.shape[0], prefill_rows):
            y = self._prompt_rows(x)
            return y if bf16_out or self.out_dtype == torch.bfloat16 else y.to(self.out_dtype)
        x = x.float()
        prompt = self._prompt_path(prefill_rows) if prefill_rows else self._blocks
        if prompt == self._blocks or prefill_rows == x.shape[0]:
            y = prompt(x)
        else:  # prompt rows on a path of their own
            y = torch.empty((x.shape[0], self.weight.shape[0]), dtype=torch.float32)
            y[:prefill_rows] = prompt(x[:prefill_rows])
            y[prefill_rows:] = self._blocks(x[prefill_rows:])
        return y if self.out_dtype == torch.float32 else y.to(self.out_dtype)

    def swiglu_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a [gate; up] linear in a bfloat16 step (`bf16_step`) on AMX tiles:
        silu(x @ gate.T) * (x @ up.T) in bfloat16 in one pass (the same bits as silu_mul over
        what __call__ returns with bf16_out, without writing and reading back that [T, 2I]
        output); None where this linear cannot (then call it and silu_mul)."""
        if self._gemm is None or self.weight.shape[0] % 32:
            return None
        return gguf_kernels.gemm_bf16_amx_swiglu(self._gemm, x.to(torch.bfloat16), self._bf16, self.weight.shape[0])

    def _prompt_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T with the bfloat16 copy: x rounded to bfloat16, y the bfloat16 its float32
        sums round to (on AMX tiles or by oneDNN alike; so a bfloat16 step's activations are
        the numbers a float32 copy would hold)."""
        x = x.to(torch.bfloat16)
        if self._gemm is not None:
            return gguf_kernels.gemm_bf16_amx(self._gemm, x, self._bf16, self.weight.shape[0], torch.bfloat16)
        return _bf16_mm(x, self._bf16)


def _bf16_prepacked(w: torch.Tensor) -> torch.Tensor:
    """w (bfloat16 [out, in]) in oneDNN's own layout where this torch has it, else as it is."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, PREFILL_MIN_ROWS * 32)  # a batch-size hint only
    except (AttributeError, RuntimeError, NotImplementedError):
        return w


def _bf16_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in bfloat16, w from _bf16_prepacked."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return F.linear(x, w)


def make_linear(weight: torch.Tensor | GGUFWeight, *, quantization: str, dtype: torch.dtype,
                device: str, kernels: bool = True, prefill_bf16: bool = False,
                decode_bf16: bool = False, decode_i16: bool = False, prefill_i16: bool = False,
                prefill_i8: bool = False):
    """weight: float [out, in], or a GGUF file's blocks (quantization "auto").
    kernels=False: torch ops only (the eager switch, for debugging and comparison).
    prefill_bf16: GGUF linears keep a bfloat16 copy for prompt rows (`prefill_in_bfloat16`).
    decode_bf16: their other rows in bfloat16 arithmetic (`decode_in_bfloat16`).
    decode_i16: their decode rows with the input in 16-bit fixed point (`decode_in_int16`).
    prefill_i16: their prompt rows likewise (`prefill_in_int16`).
    prefill_i8: Q4_0/Q4_1 prompt rows with the input in int8 (`prefill_in_int8`)."""
    if isinstance(weight, GGUFWeight):
        lib = gguf_kernels.load() if kernels and device == "cpu" and quantization == "auto" else None
        if lib is not None:
            return GGUFLinear(weight, dtype, lib, prefill_bf16, decode_bf16, decode_i16, prefill_i16, prefill_i8)
        # torch: the file's numbers, dequantized once
        return DenseLinear(weight.dequantize().to(device=device, dtype=dtype).contiguous())
    if quantization == "auto":  # float weights: int8 where the AVX2 kernel runs, else dense
        kernels_here = kernels and device == "cpu" and cpu_kernels.load() is not None
        quantization = "int8" if kernels_here else "none"
    if quantization == "none":
        return DenseLinear(weight.to(device=device, dtype=dtype).contiguous())
    if quantization == "int8":
        return Int8Linear(weight.to(device), out_dtype=dtype, kernels=kernels)
    raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
