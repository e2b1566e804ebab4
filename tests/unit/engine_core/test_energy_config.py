"""Energy sources (RAPL with wrap-around, estimated watts) and the engine config checks."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.config import EngineConfig
from services.engine.energy import EstimatedPower, RaplCounter, energy_source


def zone(root: Path, name: str, uj: int, rng: int = 1_000_000) -> Path:
    z = root / name
    z.mkdir()
    (z / "energy_uj").write_text(str(uj))
    (z / "max_energy_range_uj").write_text(str(rng))
    return z


def test_rapl_sums_packages_ignores_subzones_and_unwraps(tmp_path):
    p0 = zone(tmp_path, "intel-rapl:0", 900_000)
    zone(tmp_path, "intel-rapl:0:0", 5)  # core subzone: already inside package 0
    p1 = zone(tmp_path, "intel-rapl:1", 10)
    src = energy_source(20.0, tmp_path)
    assert isinstance(src, RaplCounter) and not src.estimated
    (p0 / "energy_uj").write_text("100000")  # wrapped: +200_000 uJ
    (p1 / "energy_uj").write_text("300010")  # +300_000 uJ
    assert src.read_joules() == pytest.approx(0.5)


def test_without_readable_counters_power_is_estimated(tmp_path):
    t = [10.0]
    src = energy_source(20.0, tmp_path)
    assert isinstance(src, EstimatedPower) and src.estimated
    est = EstimatedPower(20.0, clock=lambda: t[0])
    t[0] = 12.5
    assert est.read_joules() == pytest.approx(50.0)
    with pytest.raises(ValueError):
        EstimatedPower(0)


def test_engine_config_rejects_bad_values(tmp_path):
    ok = dict(model_path=tmp_path)
    EngineConfig(**ok)
    for bad in (dict(port=70000), dict(device="tpu"), dict(dtype="int4"), dict(block_size=12),
                dict(max_concurrency=0), dict(max_batched_tokens=8), dict(kv_cache_mb=0),
                dict(watts=0), dict(etcd_endpoints=("nohostport",)), dict(quantization="q2"),
                dict(itl_target_ms=-5), dict(itl_target_ms=float("nan")), dict(burst_hold_ms=-1)):
        with pytest.raises(ValueError):
            EngineConfig(**ok, **bad)
