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

from services.engine import isa  # noqa: E402

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


ISA_SHIM = ROOT / "bench" / "isa_shim"  # sitecustomize for peers' Python processes (vLLM)


def add_isa_arg(ap) -> None:
    ap.add_argument("--isa", default="auto", choices=isa.LEVELS,
                    help="measure as on a CPU with only these instruction sets (TOKENSERVE_CPU_ISA"
                         " for the engine, the same cap for torch, transformers and vLLM; give"
                         " llama.cpp a build for it: bench/build_llama_server.sh DIR avx2)")


def run_capped(level: str) -> None:
    """Makes this benchmark run as on a CPU of `level`: where the environment does not say so
    yet, sets TOKENSERVE_CPU_ISA and torch's caps (isa.torch_env, read when torch loads) and
    re-executes the process, so in-process peers and every process it starts see that CPU."""
    want = {isa.CPU_ISA_ENV: level, **isa.torch_env(level)}
    if level == "auto" and os.environ.get(isa.CPU_ISA_ENV, "auto") == "auto":
        return
    if all(os.environ.get(k) == v for k, v in want.items()):
        return
    os.environ.update(want)
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def peer_env(env: dict[str, str]) -> dict[str, str]:
    """A peer's environment under the cap: torch's CPU-feature queries, which vLLM uses to pick
    its kernel build, answer as that CPU would (bench/isa_shim/sitecustomize.py)."""
    if isa.cap() in ("avx2", "none"):
        env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ISA_SHIM), env.get("PYTHONPATH")]))}
    return env


def cpu_model() -> str:
    """/proc/cpuinfo's model name ("" where unreadable): machines of one flag set differ."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return ""


def machine_facts(model_path: Path | None = None) -> dict:
    """The CPU (its model name and own flags), and the cap the run was measured under
    (`isa_cap`, with the key flags the kernels were allowed: `cpu_key_flags_used`)."""
    flags = isa.hardware_flags()
    facts = {"cpu_model": cpu_model(),
             "cpus": len(os.sched_getaffinity(0)),
             "cpu_key_flags": [f for f in KEY_FLAGS if f in flags],
             "cpu_flags": sorted(flags),
             "isa_cap": isa.cap(),
             "cpu_key_flags_used": [f for f in KEY_FLAGS if f in isa.cpu_flags()],
             "torch_isa_env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                          "MKL_ENABLE_INSTRUCTIONS") if k in os.environ},
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
