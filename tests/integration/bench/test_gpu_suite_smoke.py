"""bench/gpu_suite.py end to end in --smoke mode on the CPU (a real process, the real gateway
suite), so the script is known to run on a GPU machine except for its CUDA-only parts."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]


def test_gpu_suite_smoke_writes_every_section(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.gpu_suite", "--smoke", "--device", "cpu",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert (tmp_path / "gpu_suite.png").stat().st_size > 10_000
    assert res["smoke"] and res["device"] == "cpu" and res["machine"]["cpu_flags"]
    for name in ("correctness", "decode", "step_loop", "gateway"):
        assert isinstance(res[name], dict) and "error" not in res[name], res[name]

    c = res["correctness"]
    assert c["pass"] and c["exact_fast_path"]["prompts_identical"] == 3  # == transformers
    assert c["implicit_syncs_per_decode_step"].startswith("skipped")  # CUDA only

    tiny = res["decode"]["models"]["tiny"]
    assert set(tiny["batches"]) == {"1", "4"}
    for row in tiny["batches"].values():
        assert row["tokenserve"]["decode_tok_s"] > 0 and row["transformers"]["decode_tok_s"] > 0
        assert row["tokenserve"]["joules"] > 0  # RAPL, or the estimate (flagged)
    assert res["decode"]["energy_source"] in ("rapl", "estimated")
    assert tiny["roofline_b1_tok_s"] > 0 and tiny["batches"]["1"]["roofline_fraction"] > 0

    loop = res["step_loop"]  # the overlapped order runs on the CPU too (no gain expected)
    assert loop["outputs_equal"] and loop["plain"]["tok_s"] > 0 and loop["overlapped"]["tok_s"] > 0

    g = res["gateway"]
    assert g["errors"] == 0 and g["tokens"] > 0 and g["requests"] >= g["streams"]
    assert set(g["exit_codes"].values()) == {0}, (g["exit_codes"], g.get("unclean_exit_log_tails"))
    assert set(res["goals"]["targets"]) >= {"gateway_tok_s", "smollm2_b1_tok_s"}
