"""TOKENSERVE_CPU_ISA: which of the CPU's instruction sets the kernels may use."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.engine import isa

# a Zen 4's flags (abridged), and a Sapphire Rapids' AMX and AVX-VNNI ones
FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl",
                   "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
                   "amx_bf16"})


def test_each_level_keeps_what_a_cpu_of_that_kind_has():
    assert isa.capped(FLAGS, "auto") == FLAGS
    assert isa.capped(FLAGS, "avx512bf16") == FLAGS - {"amx_tile", "amx_bf16"}
    assert isa.capped(FLAGS, "avx512") == FLAGS - {"amx_tile", "amx_bf16", "avx512_bf16", "avx512_fp16"}
    assert isa.capped(FLAGS, "avxvnni") == {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni"}
    assert isa.capped(FLAGS, "avx2") == {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
    assert isa.capped(FLAGS, "none") == {"sse4_2", "bmi2"}


def test_the_cap_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(isa.CPU_ISA_ENV, raising=False)
    assert isa.cap() == "auto"
    monkeypatch.setenv(isa.CPU_ISA_ENV, " AVX2 ")
    assert isa.cap() == "avx2"
    assert isa.cpu_flags() == isa.capped(isa.hardware_flags(), "avx2")
    assert not any(f.startswith("avx512") for f in isa.cpu_flags())


def test_an_unknown_level_names_the_ones_there_are(monkeypatch):
    monkeypatch.setenv(isa.CPU_ISA_ENV, "avx3")
    with pytest.raises(ValueError, match="TOKENSERVE_CPU_ISA must be one of auto, avx512bf16, avx512, avxvnni,"
                                         " avx2, none, not 'avx3'"):
        isa.cpu_flags()


def test_torch_is_capped_only_where_the_operator_has_not_set_its_own(monkeypatch):
    monkeypatch.setenv(isa.CPU_ISA_ENV, "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI")
    for name in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(name, raising=False)
    assert isa.apply_to_torch() == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2_VNNI"
    monkeypatch.setenv(isa.CPU_ISA_ENV, "auto")
    assert isa.torch_env("auto") == {}


def test_the_engine_refuses_an_unknown_level_at_start():
    done = subprocess.run([sys.executable, "-m", "services.engine"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, isa.CPU_ISA_ENV: "avx3"})
    assert done.returncode == 2
    assert ("error: TOKENSERVE_CPU_ISA must be one of auto, avx512bf16, avx512, avxvnni, avx2, none,"
            " not 'avx3'"
            in done.stderr)


ZEN1 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 1
model name\t: AMD EPYC 7551 32-Core Processor
flags\t\t: fpu avx2 fma f16c

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 23
"""


def test_the_cpu_model_is_the_first_processors_vendor_and_family():
    assert isa.cpu_model(ZEN1) == ("AuthenticAMD", 23)
    assert isa.cpu_model("vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t: 143\n") == ("GenuineIntel", 6)
    assert isa.cpu_model("processor\t: 0\n") == ("", 0)  # neither listed (an emulator, another arch)
    vendor, family = isa.cpu_model()  # this machine's, read from /proc/cpuinfo
    assert isinstance(vendor, str) and family >= 0


def test_16_bit_multiplies_count_as_slow_only_on_zen_1_and_2():
    from services.engine.gguf_kernels import int16_multiplies_fast
    assert not int16_multiplies_fast(isa.cpu_model(ZEN1))  # family 17h: Zen 1, Zen+, Zen 2
    assert not int16_multiplies_fast(("HygonGenuine", 0x18))  # Hygon Dhyana: a Zen 1
    assert int16_multiplies_fast(("AuthenticAMD", 0x19))  # Zen 3, Zen 4
    assert int16_multiplies_fast(("AuthenticAMD", 0x1A))  # Zen 5
    assert int16_multiplies_fast(("GenuineIntel", 6))
    assert int16_multiplies_fast(("", 0))  # unknown: the integer path (the same bits either way)
