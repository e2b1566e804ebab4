"""Facts about the machine every benchmark records: CPU flags, copy bandwidth, and the
memory-bandwidth roofline of decoding the bundled model with the engine's default weights.

roofline tok/s (one stream) = measured copy bandwidth / bytes the engine reads per token,
where the bytes are the GGUF file's blocks of every linear layer (what the default mode
multiplies; the embedding lookup and the KV cache add little at these lengths).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine.cpu_kernels import cpu_flags  # noqa: E402

# the flags that decide which kernels run (all of /proc/cpuinfo's are recorded too)
KEY_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "avx512vbmi", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def copy_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """Bytes read + written per second by a large numpy copy (median), in GB/s."""
    import numpy as np

    src = np.ones(mib * 2**20 // 8)
    dst = np.empty_like(src)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        samples.append(2 * src.nbytes / (time.perf_counter() - t0))
    return statistics.median(samples) / 1e9


def default_weight_bytes(model_path: Path) -> int:
    """Bytes of the linear weights one decode step reads in the engine's default mode."""
    from services.engine.loader import load_weights

    loaded = load_weights(model_path, keep_blocks=True)
    c = loaded.config
    head = "embed" if c.tie_embeddings else "lm_head"
    total = 0
    for name, w in loaded.quantized.items():
        if name.startswith("layers.") or name == head:
            total += w.blocks.numel()
    for name, t in loaded.tensors.items():  # linear weights the kernels could not keep as blocks
        if name != "embed" and t.dim() == 2:
            total += t.numel()  # int8: one byte each
    return total


def machine_facts(model_path: Path | None = None) -> dict:
    flags = cpu_flags()
    facts = {"cpus": len(os.sched_getaffinity(0)),
             "cpu_key_flags": [f for f in KEY_FLAGS if f in flags],
             "cpu_flags": sorted(flags),
             "copy_bandwidth_gbs": round(copy_bandwidth_gbs(), 2)}
    if model_path is not None:
        b = default_weight_bytes(model_path)
        facts["default_bytes_per_token"] = b
        facts["roofline_tok_s_one_stream"] = round(facts["copy_bandwidth_gbs"] * 1e9 / b, 1)
    return facts


def gpu_copy_bandwidth_gbs(device: str = "cuda", mib: int = 2048, repeats: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy of mib MiB (median of
    repeats, CUDA events), in GB/s: the ceiling a memory-bound decode step is measured against."""
    import torch

    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(2 * src.nbytes / (start.elapsed_time(end) / 1e3))
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(samples) / 1e9


def gpu_facts(device: str = "cuda") -> dict:
    """The GPU, its driver and the library versions the numbers depend on."""
    import importlib.metadata as md

    import torch

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    p = torch.cuda.get_device_properties(torch.device(device))
    facts = {"name": p.name, "capability": f"{p.major}.{p.minor}",
             "multiprocessors": p.multi_processor_count,
             "memory_gib": round(p.total_memory / 2**30, 1), "torch": torch.__version__,
             "cuda": torch.version.cuda, "triton": version("triton"),
             "transformers": version("transformers"), "nvidia_ml_py": version("nvidia-ml-py")}
    try:
        import pynvml

        pynvml.nvmlInit()
        facts["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # noqa: BLE001 - a fact we could not read is left out
        facts["driver"] = None
    facts["copy_bandwidth_gbs"] = round(gpu_copy_bandwidth_gbs(device), 1)
    return facts
