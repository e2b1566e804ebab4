"""Put on PYTHONPATH of a peer's processes by a benchmark run with `--isa avx512`, `avxvnni`,
`avx2` or `none` (bench/machine.py peer_env): torch's CPU-feature queries answer as a CPU of
that kind would (below avx512: no AVX-512 or AMX; at avx512: no AVX512-BF16 or AMX, as a
Cascade Lake or Ice Lake), so vLLM loads the kernel build such a CPU gets
(vllm/platforms/cpu.py picks by them) and chooses its attention and linear paths as it would
there. ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA, set by the benchmark, cap torch's own
kernels and inductor's code."""
import os

_LEVEL = os.environ.get("TOKENSERVE_CPU_ISA", "").strip().lower()
_HIDDEN = {"avx512": ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported")}
_BELOW_AVX512 = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                 "_is_amx_tile_supported", "_is_amx_fp16_supported", "_is_vnni_supported")

if _LEVEL in ("avx512", "avxvnni", "avx2", "none"):
    import torch.cpu

    for _query in _HIDDEN.get(_LEVEL, _BELOW_AVX512):
        if hasattr(torch.cpu, _query):
            setattr(torch.cpu, _query, lambda: False)
