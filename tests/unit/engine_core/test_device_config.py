"""Device-dependent flags and config of the engine: --dtype auto (bfloat16 on CUDA, float32
on the CPU) and --eager (no CUDA graphs)."""
from __future__ import annotations

import pytest

from services.engine.config import COMPUTE_DTYPES, EngineConfig, resolve_dtype
from services.engine.main import parse_args


def test_dtype_auto_is_the_default_and_resolves_by_device(tmp_path):
    c = parse_args(["--model-path", str(tmp_path)])
    assert c.dtype == "auto" and c.device == "cpu"
    assert resolve_dtype(c.dtype, c.device) == "float32"  # today's CPU behaviour
    g = parse_args(["--model-path", str(tmp_path), "--device", "cuda"])
    assert resolve_dtype(g.dtype, g.device) == "bfloat16"
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    for explicit in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(explicit, "cuda") == explicit == resolve_dtype(explicit, "cpu")
        assert parse_args(["--model-path", str(tmp_path), "--dtype", explicit]).dtype == explicit


def test_unknown_dtypes_are_refused_by_flags_config_and_resolver(tmp_path):
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tmp_path), "--dtype", "int4"])
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model_path=tmp_path, dtype="int4")
    with pytest.raises(ValueError):
        resolve_dtype("float8", "cpu")
    assert set(COMPUTE_DTYPES) == {"auto", "float32", "bfloat16", "float16"}


def test_exact_takes_the_auto_default_to_float32_and_refuses_bfloat16(tmp_path):
    e = parse_args(["--model-path", str(tmp_path), "--exact"])
    assert (e.quantization, e.dtype, e.kv_cache_dtype) == ("none", "float32", "float32")
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tmp_path), "--exact", "--dtype", "bfloat16"])


def test_eager_switch_turns_cuda_graphs_off(tmp_path):
    assert parse_args(["--model-path", str(tmp_path)]).eager is False  # graphs on CUDA
    assert parse_args(["--model-path", str(tmp_path), "--device", "cuda", "--eager"]).eager is True
