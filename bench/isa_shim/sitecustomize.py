"""Put on PYTHONPATH of a peer's processes by a benchmark run with `--isa avxvnni`, `avx2` or `none`
(bench/machine.py peer_env): torch's CPU-feature queries answer as a CPU without AVX-512 or
AMX would, so vLLM loads its AVX2 kernel build (vllm/platforms/cpu.py picks by them) and
chooses its attention and linear paths as it would on such a CPU. ATEN_CPU_CAPABILITY and
ONEDNN_MAX_CPU_ISA, set by the benchmark, cap torch's own kernels and inductor's code."""
import os

if os.environ.get("TOKENSERVE_CPU_ISA", "").strip().lower() in ("avxvnni", "avx2", "none"):
    import torch.cpu

    for _query in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                   "_is_amx_tile_supported", "_is_amx_fp16_supported", "_is_vnni_supported"):
        if hasattr(torch.cpu, _query):
            setattr(torch.cpu, _query, lambda: False)
