"""EngineCore on a fake runner: batched == unbatched, cancellation, deadlines, stop strings,
energy attribution, a failing step."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest

from services.engine.block_manager import BlockManager
from services.engine.engine_core import EngineCore
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import FinishReason
from tests.unit.engine_core.fakes import EOS, FakeRunner, make_seq, reference_output


class WordStream:
    """Each token is the word 'w<id> '; holds back text that may start a stop string."""

    def __init__(self, stops):
        self.stops, self.pending = stops, ""

    def push(self, tok):
        self.pending += f"w{tok} "
        for s in self.stops:
            if (i := self.pending.find(s)) >= 0:
                out, self.pending = self.pending[:i], ""
                return out, True
        keep = max((k for s in self.stops for k in range(len(s), 0, -1)
                    if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, False

    def flush(self):
        out, self.pending = self.pending, ""
        return out


class Joules:
    estimated = True

    def __init__(self):
        self.total = 0.0

    def read_joules(self):
        self.total += 2.0
        return self.total


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        self.t += 0.01
        return self.t


def make_core(num_blocks=256, block_size=4, max_num_seqs=16, budget=64, **kw):
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      max_model_len=4096), BlockManager(num_blocks, block_size), {EOS})
    runner = FakeRunner(num_blocks, block_size)
    core = EngineCore(runner, sched, text_stream=lambda s: WordStream(s.stop.stop), **kw)
    return core, runner


def drain(core, limit=10_000):
    outs = []
    for _ in range(limit):
        if not core.has_work():
            return outs
        outs.extend(core.step())
    raise AssertionError("engine did not finish")


def test_batched_results_equal_unbatched():
    rng = random.Random(1)
    core, _ = make_core(num_blocks=128, max_num_seqs=8, budget=24)
    seqs = [make_seq(i, rng.randint(1, 60), max_tokens=rng.randint(1, 20)) for i in range(32)]
    for s in seqs:
        core.add(s)
    outs = drain(core)
    for s in seqs:
        expected = reference_output(s.prompt_token_ids, s.stop.max_tokens)
        streamed = [t for o in outs if o.seq_id == s.seq_id for t in o.token_ids]
        assert streamed == expected
        finals = [o for o in outs if o.seq_id == s.seq_id and o.finished]
        assert len(finals) == 1 and finals[0].final.completion_tokens == len(expected)


def test_cancelling_100_streams_at_random_points_returns_every_block():
    rng = random.Random(7)
    core, runner = make_core(num_blocks=96, block_size=4, max_num_seqs=12, budget=48)
    initial = core.scheduler.blocks.num_free_blocks
    shared = list(range(1, 30))  # some requests share a prefix (cached, ref-counted blocks)
    live = {}
    for i in range(100):
        prompt = shared + [i] * rng.randint(0, 20) if i % 3 == 0 else None
        s = make_seq(i, rng.randint(1, 40), prompt=prompt, max_tokens=1000, ignore_eos=True)
        core.add(s)
        live[i] = s
    cancelled = 0
    while core.has_work():
        core.step()
        for sid in list(live):
            if rng.random() < 0.1:
                out = core.abort(sid)
                assert out is not None and out.finish_reason is FinishReason.CANCELLED
                del live[sid]
                cancelled += 1
    assert cancelled == 100
    assert core.scheduler.blocks.num_free_blocks == initial
    assert core.abort(3) is None  # already gone


def test_deadline_expiry_ends_the_request_at_the_next_step():
    clock = Clock()
    core, _ = make_core(clock=clock)
    s = make_seq(1, 5, max_tokens=1000, ignore_eos=True, deadline=clock.t + 0.1)
    core.add(s)
    outs = drain(core)
    final = [o for o in outs if o.finished]
    assert final[0].finish_reason is FinishReason.CANCELLED
    assert core.scheduler.blocks.num_free_blocks == 256


def test_stop_string_cuts_the_text_and_ends_generation():
    core, runner = make_core()
    s = make_seq(1, 5, max_tokens=50, stop=("w7 w8",))
    runner.script = {1: [3, 4, 7, 8, 9]}
    core.add(s)
    outs = drain(core)
    text = "".join(o.text for o in outs)
    assert text == "w3 w4 "
    assert outs[-1].finish_reason is FinishReason.STOP
    assert s.output_token_ids == [3, 4, 7, 8]


def test_held_back_text_is_flushed_when_length_ends_it():
    core, runner = make_core()
    s = make_seq(1, 5, max_tokens=3, stop=("w7 w8",))
    runner.script = {1: [3, 4, 7]}
    core.add(s)
    outs = drain(core)
    assert "".join(o.text for o in outs) == "w3 w4 w7 "
    assert outs[-1].finish_reason is FinishReason.LENGTH


def test_usage_timings_logprobs_and_energy_on_the_last_message():
    core, _ = make_core(energy=Joules(), clock=Clock())
    a = make_seq(1, 8, max_tokens=3, logprobs=True)
    b = make_seq(2, 8, max_tokens=3)
    core.add(a)
    core.add(b)
    outs = drain(core)
    fa = next(o for o in outs if o.seq_id == 1 and o.finished).final
    fb = next(o for o in outs if o.seq_id == 2 and o.finished).final
    assert (fa.prompt_tokens, fa.completion_tokens) == (8, 3)
    assert 0 < fa.queue_seconds <= fa.time_to_first_token_seconds <= fa.total_seconds
    # 2 J per step, split by tokens computed; both did the same work
    assert fa.energy_estimated and abs(fa.energy_joules - fb.energy_joules) < 1e-9
    assert abs(fa.energy_joules + fb.energy_joules - 2.0 * 3) < 1e-9
    assert all(len(o.logprobs) == len(o.token_ids) for o in outs if o.seq_id == 1)
    assert all(not o.logprobs for o in outs if o.seq_id == 2)


def test_energy_is_split_by_tokens_computed_not_equally():
    """A 40-token prompt beside a 4-token one: each step's joules go by the tokens each
    request computed in it (an equal split per request would give them the same)."""
    core, runner = make_core(energy=Joules(), clock=Clock(), budget=64)
    a = make_seq(1, 40, max_tokens=3, speculation=False)
    b = make_seq(2, 4, max_tokens=3, speculation=False)
    core.add(a)
    core.add(b)
    outs = drain(core)
    expected = {1: 0.0, 2: 0.0}
    for batch in runner.batches:  # Joules: 2 J between the reads around each step
        step_tokens = batch.num_tokens
        for c in batch.chunks:
            expected[c.seq_id] += 2.0 * len(c.token_ids) / step_tokens
    got = {o.seq_id: o.final.energy_joules for o in outs if o.finished}
    assert got[1] == pytest.approx(expected[1]) and got[2] == pytest.approx(expected[2])
    assert got[1] + got[2] == pytest.approx(2.0 * len(runner.batches))
    # both prompts whole in the first step (40 vs 4 tokens), then one token each per step
    assert got[1] - got[2] == pytest.approx(2.0 * (40 - 4) / 44)


def test_a_failing_step_ends_its_requests_with_error_and_the_engine_goes_on():
    core, runner = make_core()
    core.add(make_seq(1, 5, max_tokens=5))
    runner.fail_next = True
    outs = core.step()
    assert [o.finish_reason for o in outs] == [FinishReason.ERROR]
    assert core.scheduler.blocks.num_free_blocks == 256
    core.add(make_seq(2, 5, max_tokens=2))
    assert drain(core)[-1].finish_reason is FinishReason.LENGTH


def test_scheduler_and_block_manager_do_not_import_torch():
    code = ("import sys; import services.engine.scheduler, services.engine.block_manager, "
            "services.engine.engine_core, services.engine.sequence; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_metrics_observer_counts_tokens_latencies_and_finishes():
    from prometheus_client import REGISTRY

    from services.engine.metrics import EngineMetrics

    def value(name, labels=None):
        return REGISTRY.get_sample_value(name, labels or {}) or 0.0

    before = {n: value(n) for n in ("tokenserve_engine_generated_tokens_total",
                                    "tokenserve_engine_time_to_first_token_seconds_count",
                                    "tokenserve_engine_inter_token_latency_seconds_count")}
    stopped = value("tokenserve_engine_requests_total", {"finish_reason": "length"})
    core, _ = make_core(observer=EngineMetrics(), clock=Clock())
    for i in range(3):
        core.add(make_seq(i, 6, max_tokens=4))
    drain(core)
    assert value("tokenserve_engine_generated_tokens_total") - before[
        "tokenserve_engine_generated_tokens_total"] == 12
    assert value("tokenserve_engine_time_to_first_token_seconds_count") - before[
        "tokenserve_engine_time_to_first_token_seconds_count"] == 3
    assert value("tokenserve_engine_inter_token_latency_seconds_count") - before[
        "tokenserve_engine_inter_token_latency_seconds_count"] == 9
    assert value("tokenserve_engine_requests_total", {"finish_reason": "length"}) - stopped == 3
    assert value("tokenserve_engine_kv_blocks_free") == 256


def test_energy_metrics_count_joules_and_tokens_per_joule():
    from prometheus_client import REGISTRY

    from services.engine.metrics import EngineMetrics

    joules_before = REGISTRY.get_sample_value("tokenserve_engine_energy_joules_total") or 0.0
    core, runner = make_core(observer=EngineMetrics(), energy=Joules(), clock=Clock())
    for i in range(2):
        core.add(make_seq(i + 1, 8, max_tokens=3, speculation=False))
    drain(core)
    joules = 2.0 * len(runner.batches)
    assert REGISTRY.get_sample_value("tokenserve_engine_energy_joules_total") - joules_before \
        == pytest.approx(joules)
    # (8 prompt + 3 completion) tokens each, over the joules they were given
    assert REGISTRY.get_sample_value("tokenserve_engine_tokens_per_joule") \
        == pytest.approx(2 * 11 / joules)
