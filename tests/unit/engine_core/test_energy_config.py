"""Energy sources (NVML over a fake pynvml, RAPL with wrap-around, estimated watts) and the
engine config checks."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.config import EngineConfig
from services.engine.energy import (EstimatedPower, NvmlCounter, RaplCounter, energy_source,
                                   nvml_counter, nvml_delta_mj)


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
                dict(itl_target_ms=-5), dict(itl_target_ms=float("nan")), dict(burst_hold_ms=-1),
                dict(prompt_wait_ms=-1)):
        with pytest.raises(ValueError):
            EngineConfig(**ok, **bad)


class FakeNvml:
    """pynvml's functions the reader uses, over a list of (uuid, millijoules) devices."""

    class NVMLError(Exception):
        pass

    def __init__(self, devices, *, supported=True, init_fails=False):
        self.devices = [list(d) for d in devices]
        self.supported, self.init_fails = supported, init_fails
        self.fail_reads = False

    def nvmlInit(self):
        if self.init_fails:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return self.devices[h][0]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if not self.supported or self.fail_reads:
            raise self.NVMLError("Not Supported")
        return self.devices[h][1]


def test_nvml_counts_millijoule_deltas_of_the_selected_gpu():
    nvml = FakeNvml([("GPU-aaaa", 5_000), ("GPU-bbbb", 70_000)])
    src = energy_source(20.0, device="cuda:1", nvml=nvml)
    src.min_interval_s = 0  # every read asks the driver (see the interval test below)
    assert isinstance(src, NvmlCounter) and not src.estimated and src.name == "nvml"
    nvml.devices[1][1] += 2_500  # mJ
    nvml.devices[0][1] += 999_999  # another GPU: not this engine's
    assert src.read_joules() == pytest.approx(2.5)
    nvml.devices[1][1] += 500
    assert src.read_joules() == pytest.approx(3.0)  # a running total
    nvml.fail_reads = True  # a transient error adds nothing and raises nothing
    assert src.read_joules() == pytest.approx(3.0)


def test_nvml_matches_the_cuda_uuid_not_the_index():
    """CUDA_VISIBLE_DEVICES renumbers CUDA devices; NVML numbers them all: match by UUID."""
    nvml = FakeNvml([(b"GPU-aaaa", 0), ("GPU-BBBB", 100)])
    src = nvml_counter("cuda:0", uuid="bbbb", nvml=nvml, min_interval_s=0)
    nvml.devices[1][1] += 1_000
    nvml.devices[0][1] += 7_000
    assert src.read_joules() == pytest.approx(1.0)
    assert nvml_counter("cuda:0", uuid="GPU-aaaa", nvml=nvml) is not None  # bytes, prefix
    assert nvml_counter("cuda:0", uuid="cccc", nvml=nvml) is None  # never another GPU's
    assert nvml_counter("cuda:5", nvml=nvml) is None


def test_nvml_counter_wrap_and_driver_reset():
    top = (1 << 64) - 1_000
    assert nvml_delta_mj(top, 500) == 1_500  # the 64-bit counter wrapped
    assert nvml_delta_mj(80_000, 300) == 300  # reset to zero (driver reloaded)
    assert nvml_delta_mj(10, 10) == 0
    nvml = FakeNvml([("GPU-a", top)])
    src = nvml_counter("cuda", nvml=nvml, min_interval_s=0)
    nvml.devices[0][1] = 2_000
    assert src.read_joules() == pytest.approx(3.0)


def test_nvml_is_read_at_most_every_interval_and_interpolated_between():
    """Steps shorter than the interval get the last measured power times their time, without
    a driver call; the running total never decreases and catches up with the counter."""
    t = [0.0]
    nvml = FakeNvml([("GPU-a", 0)])
    reads = [0]
    real = nvml.nvmlDeviceGetTotalEnergyConsumption

    def counted(h):
        reads[0] += 1
        return real(h)

    nvml.nvmlDeviceGetTotalEnergyConsumption = counted
    src = nvml_counter("cuda", nvml=nvml, min_interval_s=0.02, clock=lambda: t[0])
    t[0], nvml.devices[0][1] = 0.1, 30_000  # 30 J over 0.1 s: 300 W
    assert src.read_joules() == pytest.approx(30.0) and reads[0] == 2
    t[0] = 0.11  # 10 ms later: no driver call, 300 W x 0.01 s
    assert src.read_joules() == pytest.approx(33.0) and reads[0] == 2
    t[0], nvml.devices[0][1] = 0.13, 32_000  # the counter says less than was reported:
    assert src.read_joules() == pytest.approx(33.0) and reads[0] == 3  # held, not decreased
    t[0], nvml.devices[0][1] = 0.2, 40_000
    assert src.read_joules() == pytest.approx(40.0)  # the counter's total again


def test_without_nvml_the_order_is_rapl_then_watts(tmp_path):
    zone(tmp_path, "intel-rapl:0", 10)
    for nvml in (FakeNvml([("GPU-a", 1)], supported=False),  # a GPU without the counter
                 FakeNvml([("GPU-a", 1)], init_fails=True),  # no driver
                 FakeNvml([])):  # no GPU
        assert isinstance(energy_source(20.0, tmp_path, device="cuda", nvml=nvml), RaplCounter)
    empty = tmp_path / "none"
    empty.mkdir()
    assert isinstance(energy_source(20.0, empty, device="cuda", nvml=FakeNvml([])), EstimatedPower)
    # a CPU engine never asks NVML (the GPU's energy is not its own)
    assert isinstance(energy_source(20.0, tmp_path, nvml=FakeNvml([("GPU-a", 1)])), RaplCounter)


def test_nvml_is_imported_lazily_and_is_optional(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert nvml_counter("cuda") is None
