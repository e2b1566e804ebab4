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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine import cpu_kernels, gguf_kernels
from services.engine.gguf_kernels import GGUFWeight

QUANTIZATIONS = ("auto", "none", "int8")


class DenseLinear:
    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [out, in]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._lib is not None:
            y = cpu_kernels.int8_linear(self._lib, x.float(), self._packed, self._packed_scale,
                                        self.out_features)
            return y if self.out_dtype == torch.float32 else y.to(self.out_dtype)
        w = self._qweight.to(x.dtype)
        return F.linear(x, w) * self.scale.to(x.dtype)


class GGUFLinear:
    """The file's own blocks, multiplied by gguf_kernels (dequantized in registers)."""

    __slots__ = ("weight", "out_dtype", "_lib")

    def __init__(self, weight: GGUFWeight, out_dtype: torch.dtype, lib):
        self.weight, self.out_dtype, self._lib = weight, out_dtype, lib

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = gguf_kernels.linear(self._lib, x.float(), self.weight)
        return y if self.out_dtype == torch.float32 else y.to(self.out_dtype)


def make_linear(weight: torch.Tensor | GGUFWeight, *, quantization: str, dtype: torch.dtype,
                device: str, kernels: bool = True):
    """weight: float [out, in], or a GGUF file's blocks (quantization "auto").
    kernels=False: torch ops only (the eager switch, for debugging and comparison)."""
    if isinstance(weight, GGUFWeight):
        lib = gguf_kernels.load() if kernels and device == "cpu" and quantization == "auto" else None
        if lib is not None:
            return GGUFLinear(weight, dtype, lib)
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
