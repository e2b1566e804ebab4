"""Energy counters for per-request joules.

RAPL package counters under /sys/class/powercap (intel-rapl:N, the top-level zones: their
subzones are already inside them) when readable; otherwise a configured power figure
times elapsed time, flagged as estimated. The engine core reads the counter around each
step and splits the difference across the step's requests by tokens computed.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

POWERCAP = Path("/sys/class/powercap")


class RaplCounter:
    """Sum of the package zones' energy_uj, unwrapped (each counter wraps at its range)."""

    estimated = False

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


def energy_source(watts: float, root: Path = POWERCAP) -> RaplCounter | EstimatedPower:
    zones = rapl_zones(root)
    return RaplCounter(zones) if zones else EstimatedPower(watts)
