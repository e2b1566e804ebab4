"""The degradation ladder: a level from the engines' load, with hysteresis, and what each
tier gets at that level. Pure Python over plain data (no clock of its own, no I/O).

Signals (from the fresh reports on the LoadBoard), each divided by its threshold in the
`degradation` document to give a ratio:

    queue_depth            waiting requests per engine (mean over engines reporting)
    ttft_p99_seconds       the worst engine's TTFT p99 over its recent window
    kv_use_fraction        KV blocks used / KV blocks, over all engines
    power_watts_vs_budget  (summed engine watts / `power_budget` watts), estimated watts
                           included; off when there is no power_budget document

The worst ratio picks the level: 1 at 1x, 2 at 1.5x, 3 at 2x (schema.DEGRADATION_LEVEL_
MULTIPLES). Rising is immediate. Falling is held: level L is left only once the worst ratio
has stayed below (1 - hysteresis_margin) x L's multiple for hold_seconds, so a load sitting
at a threshold, noise and all, keeps its level instead of flapping.

What a tier gets at a level comes from the document's ladder: "queue" (served; the engine
runs it by tier priority), "cap_max_tokens" (served with max_tokens <= cap_max_tokens) or
"reject" (shed: RESOURCE_EXHAUSTED before any tokenizer or engine work, never billed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from controlplane.schema import (DEGRADATION_LEVEL_MULTIPLES, MAX_DEGRADATION_LEVEL,
                                 Degradation, PowerBudget)
from services.gateway.load import EngineLoad
from tokenserve.runtime.errors import ResourceExhausted

# Response metadata (gRPC initial metadata, HTTP header) with the gateway's level.
LEVEL_HEADER = "x-degradation-level"
# Set when this request's max_tokens was lowered by the ladder.
CAPPED_HEADER = "x-degradation-max-tokens"
MIN_RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class Signals:
    queue_depth: float = 0.0
    ttft_p99_s: float = 0.0
    kv_use: float = 0.0
    watts: float = 0.0
    watts_estimated: bool = False
    engines: int = 0

    @classmethod
    def of(cls, loads: Iterable[EngineLoad]) -> "Signals":
        loads = list(loads)
        if not loads:
            return cls()
        total_blocks = sum(x.kv_blocks_total for x in loads)
        return cls(queue_depth=sum(x.waiting for x in loads) / len(loads),
                   ttft_p99_s=max(x.ttft_p99_s for x in loads),
                   kv_use=sum(x.kv_blocks_used for x in loads) / total_blocks if total_blocks else 0.0,
                   watts=sum(x.watts for x in loads),
                   watts_estimated=any(x.watts_estimated for x in loads), engines=len(loads))


def ratios(s: Signals, policy: Degradation, budget: PowerBudget | None) -> dict[str, float]:
    """Each signal over its threshold, by the threshold's name."""
    t = policy.thresholds
    out = {"queue_depth": s.queue_depth / t.queue_depth,
           "ttft_p99_seconds": s.ttft_p99_s / t.ttft_p99_seconds,
           "kv_use_fraction": s.kv_use / t.kv_use_fraction}
    if budget is not None:
        out["power_watts_vs_budget"] = s.watts / budget.watts / t.power_watts_vs_budget
    return out


def level_of(ratio: float) -> int:
    """0 below 1x of a threshold, then 1, 2, 3 at 1x, 1.5x, 2x."""
    return sum(ratio >= m for m in DEGRADATION_LEVEL_MULTIPLES)


@dataclass(frozen=True)
class LevelState:
    level: int = 0
    signal: str = ""       # the worst signal now ("" when there is none)
    ratio: float = 0.0     # its value over its threshold
    ratios: dict[str, float] = field(default_factory=dict)
    retry_after: dict[int, float] = field(default_factory=dict)  # level -> seconds, see Ladder

    @property
    def reason(self) -> str:
        """Why the level is what it is, e.g. "queue_depth 1.6x" ("" at level 0)."""
        if not self.level:
            return ""
        return f"{self.signal} {self.ratio:.2f}x" + ("" if self.ratio >= 1 else " (held)")


class Ladder:
    """The level with hysteresis. `update` once per tick with the policy and signals now."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.level = 0
        # level -> time since which the worst ratio has stayed below that level's release
        # point ((1 - margin) x its multiple); None while it is at or above it
        self._calm_since: dict[int, float | None] = {
            lv: None for lv in range(1, MAX_DEGRADATION_LEVEL + 1)}

    def update(self, policy: Degradation | None, budget: PowerBudget | None,
               signals: Signals, now: float) -> LevelState:
        if policy is None or not policy.enabled:
            self._reset()
            return LevelState()
        by_signal = ratios(signals, policy, budget)
        worst = max(by_signal, key=lambda k: (by_signal[k], k))
        ratio = by_signal[worst]
        raw = level_of(ratio)
        calm = level_of(ratio / (1 - policy.hysteresis_margin))  # >= raw
        for lv in self._calm_since:
            if calm >= lv:
                self._calm_since[lv] = None
            elif self._calm_since[lv] is None:
                self._calm_since[lv] = now
        if raw > self.level:
            self.level = raw
        while self.level > raw:
            since = self._calm_since[self.level]
            if since is None or now - since < policy.hold_seconds:
                break
            self.level -= 1
        return LevelState(self.level, worst, ratio, by_signal, {
            lv: self._left(lv, policy.hold_seconds, now) for lv in range(1, self.level + 1)})

    def _left(self, level: int, hold: float, now: float) -> float:
        """Seconds until the level could drop below `level` (the hold still to run)."""
        since = self._calm_since[level]
        left = hold if since is None else hold - (now - since)
        return max(MIN_RETRY_AFTER_S, left)


@dataclass(frozen=True)
class Decision:
    """What admission does with one request of `tier` at the current level."""

    level: int
    tier: str
    shed: bool = False
    max_tokens_cap: int | None = None  # set: serve with max_tokens <= this
    retry_after: float = MIN_RETRY_AFTER_S

    def error(self) -> ResourceExhausted:
        err = ResourceExhausted(f"degraded: level {self.level}, {self.tier} tier shed; retry in"
                                f" {self.retry_after:.3g} s", retry_after=self.retry_after,
                                limit="degraded")
        err.metadata += ((LEVEL_HEADER, str(self.level)),)
        return err

    def capped(self, max_tokens: int) -> int:
        return max_tokens if self.max_tokens_cap is None else min(max_tokens, self.max_tokens_cap)

    def metadata(self, max_tokens: int | None = None) -> tuple[tuple[str, str], ...]:
        """The level, and the cap when it lowered `max_tokens`, as response metadata."""
        md = ((LEVEL_HEADER, str(self.level)),)
        if self.max_tokens_cap is not None and max_tokens is not None \
                and max_tokens > self.max_tokens_cap:
            md += ((CAPPED_HEADER, str(self.max_tokens_cap)),)
        return md


def shed_from(policy: Degradation, tier: str) -> int | None:
    """The lowest level at which `tier` is rejected (None: never)."""
    for level in range(1, MAX_DEGRADATION_LEVEL + 1):
        if policy.action(tier, level) == "reject":
            return level
    return None


def decide(policy: Degradation | None, state: LevelState, tier: str) -> Decision:
    if policy is None or not policy.enabled or state.level == 0:
        return Decision(state.level, tier)
    action = policy.action(tier, state.level)
    if action == "reject":
        first = shed_from(policy, tier) or state.level
        return Decision(state.level, tier, shed=True,
                        retry_after=state.retry_after.get(first, MIN_RETRY_AFTER_S))
    if action == "cap_max_tokens":
        return Decision(state.level, tier, max_tokens_cap=policy.cap_max_tokens)
    return Decision(state.level, tier)
