"""Linear layers: dense (float32 / bfloat16) or weight-only int8 (per-output-channel scales).

`make_linear(w)` returns a callable x [T, in] -> [T, out]; the model never looks inside.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

QUANTIZATIONS = ("none", "int8")


class DenseLinear:
    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [out, in]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Int8Linear:
    """Symmetric int8 weights, one float scale per output row: w ~= q * scale[:, None].

    Uses torch's packed int8 kernel (reads 1 byte per weight); its CPU kernel is fast with
    bfloat16 activations, so activations are converted around it and the result cast back.
    """

    __slots__ = ("qweight", "scale", "out_dtype")

    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype):
        w = weight.float()
        amax = w.abs().amax(dim=1).clamp(min=1e-8)
        self.scale = (amax / 127.0).to(torch.bfloat16)  # [out]
        self.qweight = torch.round(w / self.scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.out_dtype = out_dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale)
        return y.to(self.out_dtype)


def make_linear(weight: torch.Tensor, *, quantization: str, dtype: torch.dtype, device: str):
    if quantization == "none":
        return DenseLinear(weight.to(device=device, dtype=dtype).contiguous())
    if quantization == "int8":
        return Int8Linear(weight.to(device), out_dtype=dtype)
    raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
