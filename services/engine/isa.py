"""Which instruction sets the engine's kernels may use: the CPU's own, or fewer where
TOKENSERVE_CPU_ISA caps them.

The kernels pick their paths from `cpu_flags()`: /proc/cpuinfo's flags less those above the
cap. An operator caps a fleet of mixed CPUs at its lowest kind, so every engine runs the same
kernels in the same arithmetic (the bfloat16 decode of an AVX512-BF16 CPU rounds otherwise
than the float32 one of an AVX2 CPU) and a node's speed says what the others' will be; a benchmark
caps a machine to measure what a CPU without its extensions gets. Levels, highest first:

    auto        everything the CPU has (the default)
    avx512bf16  no AMX
    avx512      no AMX, AVX512-BF16 or AVX512-FP16 (Cascade Lake, Ice Lake: AVX512-VNNI stays)
    avxvnni     no AMX, no AVX-512: AVX2 and AVX-VNNI (Alder Lake on, Sierra Forest)
    avx2        AVX2/FMA/F16C: no AMX, no AVX-512, no AVX-VNNI and its kin (an AVX2-only CPU)
    none        no AVX at all: the kernels step aside and torch computes

`torch_env(cap)` gives the variables that cap torch's own kernels (ATen's dispatch, oneDNN,
MKL) the same way; they are read when torch loads, so `python -m services.engine` sets them
before it imports torch, unless the environment already does. No torch import here.
"""
from __future__ import annotations

import os
from pathlib import Path

CPU_ISA_ENV = "TOKENSERVE_CPU_ISA"
LEVELS = ("auto", "avx512bf16", "avx512", "avxvnni", "avx2", "none")  # highest first

# level -> the flag prefixes (and exact names) it leaves out
_DROPPED: dict[str, tuple[str, ...]] = {
    "auto": (),
    "avx512bf16": ("amx",),
    "avx512": ("amx", "avx512_bf16", "avx512_fp16"),
    "avxvnni": ("amx", "avx512"),
    "avx2": ("amx", "avx512", "avx_"),
    "none": ("amx", "avx", "fma", "f16c"),
}
_TORCH_ENV: dict[str, dict[str, str]] = {
    "auto": {},
    "avx512bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
    "avxvnni": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "none": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
             "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def cap() -> str:
    """The level TOKENSERVE_CPU_ISA names ("auto" when unset or empty); ValueError for any other."""
    value = os.environ.get(CPU_ISA_ENV, "").strip().lower() or "auto"
    if value not in LEVELS:
        raise ValueError(f"{CPU_ISA_ENV} must be one of {', '.join(LEVELS)}, not {value!r}")
    return value


def hardware_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists for this CPU (empty where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_model(text: str | None = None) -> tuple[str, int]:
    """(vendor_id, cpu family) as /proc/cpuinfo (or `text` in its format) gives them, ("", 0)
    where unreadable: a few kernels pick between paths of the same bits by how fast a CPU
    family runs them."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "", 0
    vendor, family = "", 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key == "cpu family" and not family:
            family = int(value) if value.strip().isdigit() else 0
        if vendor and family:
            break
    return vendor, family


def capped(flags: frozenset[str], level: str) -> frozenset[str]:
    """`flags` less those above `level`."""
    dropped = _DROPPED[level]
    return frozenset(f for f in flags if not f.startswith(dropped))


def cpu_flags() -> frozenset[str]:
    """The flags the kernels may use: the CPU's, capped by TOKENSERVE_CPU_ISA."""
    return capped(hardware_flags(), cap())


def torch_env(level: str) -> dict[str, str]:
    """The environment variables that cap torch's kernels at `level` (none for auto)."""
    return dict(_TORCH_ENV[level])


def apply_to_torch() -> dict[str, str]:
    """Sets torch_env(cap()) in os.environ where a variable is not already set; call before torch
    is imported. Returns what it set."""
    added = {k: v for k, v in torch_env(cap()).items() if k not in os.environ}
    os.environ.update(added)
    return added
