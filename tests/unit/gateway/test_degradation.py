"""The degradation ladder: levels by multiple, worst signal, power, hysteresis, tier actions.

Time is a plain number passed to `update` (a fake clock: no sleeping)."""
from __future__ import annotations

import dataclasses
import random

import pytest

from controlplane import schema
from controlplane.schema import Degradation, DegradationThresholds, PowerBudget
from controlplane.seed import default_documents
from services.gateway.degradation import Ladder, LevelState, Signals, decide, level_of
from services.gateway.load import EngineLoad
from tokenserve.runtime.errors import ResourceExhausted

TICK = 0.25


def policy(**kw) -> Degradation:
    seeded = next(d for d in default_documents() if isinstance(d, Degradation))
    th = DegradationThresholds(queue_depth=10, ttft_p99_seconds=2.0, kv_use_fraction=0.8,
                               power_watts_vs_budget=1.0)
    return dataclasses.replace(seeded, thresholds=th, **kw)


def load(endpoint="e1:1", *, waiting=0, ttft=0.0, used=0, total=100, watts=0.0,
         estimated=False) -> EngineLoad:
    return EngineLoad(endpoint, "m", "v1", waiting=waiting, running=0, kv_blocks_used=used,
                      kv_blocks_total=total, ttft_p50_s=ttft / 2, ttft_p99_s=ttft, itl_p50_s=0.0,
                      itl_p99_s=0.0, tokens_per_s=0.0, watts=watts, watts_estimated=estimated,
                      received_at=0.0)


def level(p: Degradation, *loads: EngineLoad, budget: PowerBudget | None = None) -> LevelState:
    return Ladder().update(p, budget, Signals.of(loads), now=0.0)


def test_the_multiple_of_the_threshold_picks_the_level():
    assert [level_of(r) for r in (0, 0.99, 1.0, 1.49, 1.5, 1.99, 2.0, 7)] == [0, 0, 1, 1, 2, 2, 3, 3]
    p = policy()
    assert [level(p, load(waiting=w)).level for w in (5, 10, 14, 15, 20, 40)] == [0, 1, 1, 2, 3, 3]
    assert [level(p, load(ttft=t)).level for t in (1.9, 2.0, 3.0, 4.0)] == [0, 1, 2, 3]


def test_the_worst_signal_wins_and_is_named():
    st = level(policy(), load(waiting=11, ttft=3.2, used=50))
    assert (st.level, st.signal) == (2, "ttft_p99_seconds")
    assert st.ratios == pytest.approx({"queue_depth": 1.1, "ttft_p99_seconds": 1.6,
                                       "kv_use_fraction": 0.625})
    assert st.reason == "ttft_p99_seconds 1.60x"


def test_signals_pool_the_engines():
    s = Signals.of([load("a:1", waiting=30, ttft=1.0, used=90, total=100, watts=100, estimated=True),
                    load("b:1", waiting=0, ttft=3.0, used=10, total=300, watts=50)])
    assert (s.queue_depth, s.ttft_p99_s, s.kv_use, s.watts) == (15, 3.0, 0.25, 150)
    assert s.watts_estimated and s.engines == 2
    assert Signals.of([]) == Signals()  # nothing fresh: no signal, no level
    assert level(policy()).level == 0


def test_power_climbs_the_ladder_against_the_budget():
    p = policy()
    engines = (load("a:1", watts=120, estimated=True), load("b:1", watts=120))
    assert level(p, *engines).level == 0  # no budget document: power is not a signal
    assert level(p, *engines, budget=PowerBudget(300)).level == 0
    assert level(p, *engines, budget=PowerBudget(240)).level == 1
    st = level(p, *engines, budget=PowerBudget(150))  # 240 W is 1.6x the budget
    assert (st.level, st.signal) == (2, "power_watts_vs_budget")
    tight = dataclasses.replace(p, thresholds=dataclasses.replace(p.thresholds,
                                                                  power_watts_vs_budget=0.5))
    assert level(tight, *engines, budget=PowerBudget(240)).level == 3  # 2x of 0.5


def test_a_steady_load_at_the_threshold_does_not_flap():
    p = policy(hysteresis_margin=0.1, hold_seconds=5.0)
    ladder, rng, levels = Ladder(), random.Random(7), []
    for i in range(2400):  # ten minutes of ticks, queue at the threshold +-5%
        waiting = 10 * (1 + rng.uniform(-0.05, 0.05))
        levels.append(ladder.update(p, None, Signals(queue_depth=waiting), i * TICK).level)
    first = levels.index(1)
    assert set(levels[first:]) == {1}


def test_a_level_falls_only_after_the_hold_below_the_margin():
    p = policy(hysteresis_margin=0.2, hold_seconds=10.0)
    ladder = Ladder()
    assert ladder.update(p, None, Signals(queue_depth=25), 0.0).level == 3
    # below level 3's release point (0.8 x 2 = 1.6x) but above level 2's: 3 -> 2 after the hold
    assert ladder.update(p, None, Signals(queue_depth=15.5), 1.0).level == 3
    assert ladder.update(p, None, Signals(queue_depth=15.5), 10.9).level == 3
    assert ladder.update(p, None, Signals(queue_depth=15.5), 11.0).level == 2
    # at 0.9x of the threshold: under the threshold but not under its margin: stays at 1
    for t in range(12, 100):
        st = ladder.update(p, None, Signals(queue_depth=9), float(t))
    assert (st.level, st.reason) == (1, "queue_depth 0.90x (held)")
    # calm: every held level goes once the hold has run, however high it was
    ladder.update(p, None, Signals(queue_depth=40), 100.0)
    assert ladder.update(p, None, Signals(queue_depth=0), 100.25).level == 3
    assert ladder.update(p, None, Signals(queue_depth=0), 110.0).level == 3
    assert ladder.update(p, None, Signals(queue_depth=0), 110.25).level == 0


def test_a_spike_during_the_hold_restarts_it():
    p = policy(hold_seconds=10.0)
    ladder = Ladder()
    ladder.update(p, None, Signals(queue_depth=16), 0.0)
    ladder.update(p, None, Signals(queue_depth=0), 1.0)
    ladder.update(p, None, Signals(queue_depth=16), 9.0)  # level 2 again
    assert ladder.update(p, None, Signals(queue_depth=0), 10.0).level == 2
    assert ladder.update(p, None, Signals(queue_depth=0), 19.9).level == 2
    assert ladder.update(p, None, Signals(queue_depth=0), 20.0).level == 0


def test_a_raised_threshold_or_a_disabled_ladder_brings_the_level_down():
    p = policy(hold_seconds=2.0)
    ladder = Ladder()
    assert ladder.update(p, None, Signals(queue_depth=20), 0.0).level == 3
    raised = dataclasses.replace(p, thresholds=dataclasses.replace(p.thresholds, queue_depth=100))
    assert ladder.update(raised, None, Signals(queue_depth=20), 1.0).level == 3
    assert ladder.update(raised, None, Signals(queue_depth=20), 3.0).level == 0
    ladder.update(p, None, Signals(queue_depth=20), 4.0)
    assert ladder.update(policy(enabled=False), None, Signals(queue_depth=20), 4.25).level == 0
    assert ladder.update(None, None, Signals(queue_depth=20), 4.5).level == 0


def test_what_each_tier_gets_at_each_level():
    p = policy()  # the seeded ladder
    got = {}
    for lv in range(4):
        st = LevelState(level=lv, retry_after={n: 1.0 for n in range(1, lv + 1)})
        got[lv] = {t: (d.shed, d.max_tokens_cap) for t in ("free", "standard", "premium")
                   for d in [decide(p, st, t)]}
    served, capped, shed = (False, None), (False, 256), (True, None)
    assert got[0] == {"free": served, "standard": served, "premium": served}
    assert got[1] == {"free": capped, "standard": served, "premium": served}
    assert got[2] == {"free": shed, "standard": served, "premium": served}
    assert got[3] == {"free": shed, "standard": shed, "premium": served}
    assert decide(p, LevelState(level=3), "unlisted").shed is False  # not in the ladder


def test_a_capped_request_keeps_a_smaller_max_tokens_and_says_so():
    d = decide(policy(cap_max_tokens=64), LevelState(level=1), "free")
    assert (d.capped(512), d.capped(32)) == (64, 32)
    assert d.metadata(512) == (("x-degradation-level", "1"), ("x-degradation-max-tokens", "64"))
    assert d.metadata(32) == (("x-degradation-level", "1"),)


def test_a_shed_request_says_why_and_when_to_retry():
    p = policy(hold_seconds=8.0)
    ladder = Ladder()
    ladder.update(p, None, Signals(queue_depth=16), 0.0)
    st = ladder.update(p, None, Signals(queue_depth=0), 3.0)  # calm since 3.0: 8 s to go
    err = decide(p, st, "free").error()
    assert isinstance(err, ResourceExhausted) and err.limit == "degraded"
    assert err.message.startswith("degraded: level 2, free tier shed")
    assert dict(err.metadata) == {"retry-after-ms": "8000", "limit": "degraded",
                                  "x-degradation-level": "2"}
    st = ladder.update(p, None, Signals(queue_depth=0), 9.0)
    assert decide(p, st, "free").retry_after == 2.0


def test_old_documents_read_with_the_new_settings_defaulted():
    old = {"thresholds": {"queue_depth": 256, "ttft_p99_seconds": 2.0, "kv_use_fraction": 0.95,
                          "power_watts_vs_budget": 1.0},
           "ladder": {"free": ["queue", "reject"]}, "cap_max_tokens": 256}
    d = schema.parse("degradation", old)
    assert (d.hysteresis_margin, d.hold_seconds, d.enabled) == (0.1, 10.0, True)
    assert schema.parse("gateways/g1", {"id": "g1", "endpoint": "h:1"}).degradation_level == 0


@pytest.mark.parametrize("field,value,message", [
    ("hysteresis_margin", 1.0, "hysteresis_margin must be < 1"),
    ("hysteresis_margin", -0.1, "hysteresis_margin must be >= 0"),
    ("hold_seconds", -1, "hold_seconds must be >= 0"),
    ("hold_seconds", 7200, "hold_seconds must be <= 3600"),
    ("enabled", "yes", "enabled must be true or false"),
    ("ladder", {"free": ["queue"] * 4}, "ladder.free has 4 actions; levels go to 3"),
])
def test_settings_are_validated(field, value, message):
    with pytest.raises(schema.InvalidArgument, match=message):
        policy(**{field: value})
