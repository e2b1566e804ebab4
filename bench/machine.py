"""Facts about the machine every benchmark records: CPU flags, copy bandwidth, and the
memory-bandwidth roofline of decoding the bundled model with the engine's default weights;
on request its multiply-add peaks (the compute ceiling of many concurrent streams).

roofline tok/s (one stream) = measured copy bandwidth / bytes the engine reads per token,
where the bytes are the GGUF file's blocks of every linear layer (what the default mode
multiplies; the embedding lookup and the KV cache add little at these lengths).

multiply peaks (GMAC/s, all cores, AVX2): register-only loops of bench/multiply_peak.c, the
16-bit panel tile's VPMADDWD + VPADDD and float32 FMA chains; with linear_macs (multiply-adds
per token of the model's linear layers and of its output head) a workload's multiply-adds
over the better peak is the least time any engine could take on this machine's vector units
at AVX2 (attention left out: a few percent at these lengths).
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
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


def load_model(model_path: Path):
    """The model's weights as the engine's default mode keeps them (the file's blocks)."""
    from services.engine.loader import load_weights

    return load_weights(model_path, keep_blocks=True)


def default_weight_bytes(loaded) -> int:
    """Bytes of the linear weights one decode step reads in the engine's default mode
    (loaded: load_model's)."""
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


def linear_macs(loaded) -> dict[str, int]:
    """Multiply-adds per token (loaded: load_model's): `body`, every layer's linears (Q/K/V, O,
    gate/up, down); `head`, the output head (taken only for rows whose next token is sampled)."""
    c = loaded.config
    head_name = "embed" if c.tie_embeddings else "lm_head"
    shapes = {n: tuple(w.shape) for n, w in loaded.quantized.items()}
    shapes.update({n: tuple(t.shape) for n, t in loaded.tensors.items() if t.dim() == 2})
    body = sum(n * k for name, (n, k) in shapes.items() if name.startswith("layers."))
    n, k = shapes[head_name]
    return {"body": body, "head": n * k}


def workload_macs(macs: dict[str, int], prompts: list[int], new_tokens: int) -> int:
    """Multiply-adds of streams with these prompt lengths generating new_tokens each: every
    prompt token and every generated token but the last goes through the layers, and the head
    runs once per generated token."""
    return sum((p + new_tokens - 1) * macs["body"] + new_tokens * macs["head"] for p in prompts)


PEAK_SOURCE = ROOT / "bench" / "multiply_peak.c"


def multiply_peaks_gmacs(repeats: int = 7) -> dict[str, float]:
    """The 256-bit multiply-add peaks of all this process's cores in GMAC/s (medians):
    {"int16_madd_avx2", "f32_fma_avx2"}, and "int16_vnni_avx2" where the CPU has AVX-VNNI under
    the ISA cap; {} where it has no AVX2/FMA or there is no C compiler. Measured in a child
    process (its own OpenMP team, one thread a core)."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not {"avx2", "fma"} <= isa.hardware_flags() or not cc:
        return {}
    vnni = ["-mavxvnni"] if "avx_vnni" in isa.cpu_flags() else []
    with tempfile.TemporaryDirectory() as tmp:
        lib = Path(tmp) / "multiply_peak.so"
        subprocess.run([cc, "-O3", "-mavx2", "-mfma", *vnni, "-fopenmp", "-shared", "-fPIC", str(PEAK_SOURCE),
                        "-o", str(lib)], check=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))), "OMP_PROC_BIND": "true"}
        out = subprocess.run([sys.executable, __file__, "--peaks", str(lib), str(repeats)], env=env,
                             check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def _run_peaks(lib_path: str, repeats: int) -> dict[str, float]:
    lib = ctypes.CDLL(lib_path)
    peaks = {}
    for key, name in (("int16_madd_avx2", "int16_panel_peak"), ("f32_fma_avx2", "f32_fma_peak"),
                      ("int16_vnni_avx2", "int16_vnni_peak")):
        if not hasattr(lib, name):  # built without AVX-VNNI
            continue
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int64]
        steps = 10**6
        while True:  # about 0.2 s a sample (and the clock up to speed)
            t0 = time.perf_counter()
            fn(steps)
            if time.perf_counter() - t0 > 0.2:
                break
            steps *= 2
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            macs = fn(steps)
            samples.append(macs / (time.perf_counter() - t0) / 1e9)
        peaks[key] = round(statistics.median(samples), 1)
    return peaks


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
    if isa.cap() in ("avx512", "avxvnni", "avx2", "none"):
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


def machine_facts(model_path: Path | None = None, compute: bool = False) -> dict:
    """The CPU (its model name and own flags), and the cap the run was measured under
    (`isa_cap`, with the key flags the kernels were allowed: `cpu_key_flags_used`); with
    compute, the AVX2 multiply-add peaks (multiply_peaks_gmacs) and, with a model, its
    multiply-adds per token (linear_macs)."""
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
        loaded = load_model(model_path)
        b = default_weight_bytes(loaded)
        facts["default_bytes_per_token"] = b
        facts["roofline_tok_s_one_stream"] = round(facts["copy_bandwidth_gbs"] * 1e9 / b, 1)
    if compute:
        facts["multiply_peak_gmacs"] = multiply_peaks_gmacs()
        if model_path is not None:
            facts["macs_per_token"] = linear_macs(loaded)
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


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--peaks":  # multiply_peaks_gmacs's child
        print(json.dumps(_run_peaks(sys.argv[2], int(sys.argv[3]))))
    else:
        print(json.dumps(machine_facts(compute=True), indent=2))
