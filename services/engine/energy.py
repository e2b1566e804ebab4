"""Energy counters for per-request joules.

In order of preference: NVML's total energy of the engine's GPU (a CUDA engine; the
`nvidia-ml-py` package, imported only then; Volta and later GPUs), RAPL package counters
under /sys/class/powercap (intel-rapl:N, the top-level zones: their subzones are already
inside them) when readable; otherwise a configured power figure times elapsed time, flagged
as estimated. The engine core reads the counter around each step and splits the difference
across the step's requests by tokens computed.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

POWERCAP = Path("/sys/class/powercap")


class NvmlCounter:
    """One GPU's NVML total energy (millijoules since the driver loaded), unwrapped.

    nvml: the `pynvml` module (or a stand-in with the same functions); handle: its device.
    The counter is read at most every min_interval_s (a driver call per step would cost a
    sub-millisecond GPU step more than it measures); in between, the energy is the last read
    plus the power measured over the last interval times the time since, never decreasing,
    so each step still gets joules in proportion to its time and the total follows the counter.
    """

    estimated = False
    name = "nvml"
    _WRAP = 1 << 64  # nvmlDeviceGetTotalEnergyConsumption is an unsigned long long

    def __init__(self, nvml, handle, *, min_interval_s: float = 0.02,
                 clock: Callable[[], float] = time.monotonic):
        self._nvml, self._handle = nvml, handle
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._last = self._read()
        self._t_last = clock()
        self._total_mj = 0
        self._watts = 0.0
        self._reported = 0.0

    def _read(self) -> int:
        return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))

    def read_joules(self) -> float:
        now = self._clock()
        dt = now - self._t_last
        if dt < self.min_interval_s:
            estimate = self._total_mj / 1e3 + self._watts * dt
        else:
            try:
                raw = self._read()
            except self._nvml.NVMLError:  # a transient driver error: no energy this time
                return self._reported
            delta = nvml_delta_mj(self._last, raw)
            self._watts = delta / 1e3 / dt if dt > 0 else self._watts
            self._total_mj += delta
            self._last, self._t_last = raw, now
            estimate = self._total_mj / 1e3
        self._reported = max(self._reported, estimate)
        return self._reported


def nvml_delta_mj(last: int, now: int) -> int:
    """Millijoules between two readings of NVML's 64-bit counter."""
    if now >= last:
        return now - last
    if last >= 1 << 63:  # wrapped past 2**64
        return now + NvmlCounter._WRAP - last
    return now  # reset (the driver reloaded): counting again from zero


def _uuid_key(u) -> str:
    if isinstance(u, bytes):
        u = u.decode("ascii", "replace")
    u = str(u).strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def nvml_counter(device: str = "cuda", uuid: str | None = None, nvml=None,
                 **kw) -> NvmlCounter | None:
    """NVML energy of the GPU `device` names, or None when it cannot be read (no package, no
    driver, a GPU without the counter, no device matching `uuid`).

    uuid: the CUDA device's UUID (torch's device properties; with or without "GPU-"): matched
    against NVML's devices, whose numbering ignores CUDA_VISIBLE_DEVICES. Without it the
    index of "cuda:N" (default 0) is taken as NVML's index.
    """
    if nvml is None:
        try:
            import pynvml as nvml  # nvidia-ml-py; never needed on the CPU
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        if uuid is not None:
            want = _uuid_key(uuid)
            handle = next((h for h in handles if _uuid_key(nvml.nvmlDeviceGetUUID(h)) == want), None)
        else:
            _, _, index = device.partition(":")
            i = int(index) if index.isdigit() else 0
            handle = handles[i] if i < len(handles) else None
        if handle is None:
            return None
        return NvmlCounter(nvml, handle, **kw)  # raises NVMLError where the GPU has no counter
    except nvml.NVMLError:
        return None


def cuda_device_uuid(device: str) -> str | None:
    """The UUID torch reports for a CUDA device (None where it reports none)."""
    import torch

    try:
        return str(torch.cuda.get_device_properties(torch.device(device)).uuid)
    except (AttributeError, RuntimeError, AssertionError):
        return None


class RaplCounter:
    """Sum of the package zones' energy_uj, unwrapped (each counter wraps at its range)."""

    estimated = False
    name = "rapl"

    def __init__(self, zones: list[Path]):
        self._zones = zones
        self._range = [int((z / "max_energy_range_uj").read_text()) for z in zones]
        self._last = [self._read(z) for z in zones]
        self._total_uj = 0

    @staticmethod
    def _read(zone: Path) -> int:
        return int((zone / "energy_uj").read_text())

    def read_joules(self) -> float:
        for i, z in enumerate(self._zones):
            now = self._read(z)
            delta = now - self._last[i]
            if delta < 0:  # wrapped
                delta += self._range[i]
            self._total_uj += delta
            self._last[i] = now
        return self._total_uj / 1e6


class EstimatedPower:
    """Constant watts times elapsed seconds: an estimate, reported as one."""

    estimated = True
    name = "estimated"

    def __init__(self, watts: float, clock: Callable[[], float] = time.monotonic):
        if watts <= 0:
            raise ValueError(f"watts must be > 0, got {watts}")
        self.watts = watts
        self._clock = clock
        self._t0 = clock()

    def read_joules(self) -> float:
        return (self._clock() - self._t0) * self.watts


def rapl_zones(root: Path = POWERCAP) -> list[Path]:
    """Readable top-level RAPL package zones (intel-rapl:0, intel-rapl:1, ...)."""
    zones = []
    for z in sorted(root.glob("intel-rapl:*")):
        if z.name.count(":") != 1:
            continue  # a subzone (core, dram): counted in its package already
        try:
            int((z / "energy_uj").read_text())
            int((z / "max_energy_range_uj").read_text())
        except (OSError, ValueError):
            continue
        zones.append(z)
    return zones


def energy_source(watts: float, root: Path = POWERCAP, *, device: str = "cpu",
                  gpu_uuid: str | None = None, nvml=None) -> NvmlCounter | RaplCounter | EstimatedPower:
    """The best readable counter for an engine on `device`: NVML (CUDA only), RAPL, watts."""
    if device.split(":")[0] == "cuda":
        counter = nvml_counter(device, gpu_uuid, nvml)
        if counter is not None:
            return counter
    zones = rapl_zones(root)
    return RaplCounter(zones) if zones else EstimatedPower(watts)
