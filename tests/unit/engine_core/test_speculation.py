"""Speculative decoding on the fake runner: prompt-lookup drafts, variable tokens per step,
KV rollback of rejected drafts, the prefix cache, preemption, stops, budget and the adaptive
off-switch. The fake runner checks every cached position it reads, so a rolled-back slot
that was not overwritten, or a block freed while still read, fails the test."""
from __future__ import annotations

import random

import pytest

from services.engine.block_manager import BlockManager
from services.engine.engine_core import EngineCore
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import FinishReason
from services.engine.speculation import KINDS, Acceptance, NgramDrafter, SpeculationConfig
from tests.unit.engine_core.fakes import (EOS, FakeRunner, copying_token, make_seq,
                                          next_token, reference_output)
from tests.unit.engine_core.test_engine_core import WordStream, drain

SPEC = SpeculationConfig(num_draft_tokens=6, max_draft_tokens_per_step=24)


def make(num_blocks=128, block_size=4, spec=SPEC, model=copying_token, **cfg):
    cfg.setdefault("max_num_seqs", 8)
    cfg.setdefault("max_num_batched_tokens", 64)
    cfg.setdefault("max_model_len", 4096)
    sched = Scheduler(SchedulerConfig(speculation=spec, **cfg),
                      BlockManager(num_blocks, block_size), {EOS})
    runner = FakeRunner(num_blocks, block_size)
    runner.model = model
    core = EngineCore(runner, sched, text_stream=lambda s: WordStream(s.stop.stop))
    return core, runner


def code_prompt(seed: int, n: int = 60) -> list[int]:
    """A 'file' of repeated lines with small differences: what an edit copies."""
    rng = random.Random(seed)
    line = [rng.randrange(1, 900) for _ in range(6)]
    out = []
    for i in range(n // 6):
        out += line[:5] + [(line[5] + i) % 900 + 1]
    return out


def streamed(outs, seq_id):
    return [t for o in outs if o.seq_id == seq_id for t in o.token_ids]


# -- the drafter ------------------------------------------------------------------------
def test_drafter_copies_what_followed_the_tail_earlier():
    d = NgramDrafter(SpeculationConfig(num_draft_tokens=4, min_match=3))
    toks = [5, 6, 7, 8, 9, 10, 11, 1, 2, 6, 7, 8]
    assert d.propose(toks, 10) == [9, 10, 11]  # a 3-token match drafts 3 tokens
    assert d.propose(toks, 2) == [9, 10]
    toks = [5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7, 8]
    assert d.propose(toks, 10) == [9, 10, 11, 1]  # a 4-token match: up to num_draft_tokens
    assert d.propose([1, 2, 3, 4, 5, 6], 10) == []  # nothing to copy
    assert d.propose([1, 2, 3, 9, 2, 3], 10) == []  # a 2-token match is below min_match


def test_drafter_prefers_the_occurrence_that_agrees_longest():
    d = NgramDrafter(SpeculationConfig(num_draft_tokens=2, min_match=3))
    # "1 2 3" is followed by 40 in an aligned copy and by 50 more recently
    toks = [7, 8, 1, 2, 3, 40, 41, 9, 1, 2, 3, 50, 51, 0, 7, 8, 1, 2, 3]
    assert d.propose(toks, 10) == [40, 41]


def test_drafter_pauses_when_its_drafts_miss_and_probes_again_later():
    cfg = SpeculationConfig(num_draft_tokens=4, min_acceptance=0.3, retry_after=20)
    d = NgramDrafter(cfg)
    toks = [1, 2, 3, 4, 5] * 4
    assert d.propose(toks, 4)
    misses = 0
    while d.propose(toks, 4):  # a slow average: a few misses in a row do not pause it
        d.observe(4, 0, len(toks))
        misses += 1
    assert 5 < misses < 20  # paused
    toks += [1, 2, 3, 4, 5] * 4
    assert d.propose(toks, 4) == [1, 2, 3, 4]  # 20 tokens later it tries again
    assert (d.proposed, d.accepted) == (4 * misses, 0)


def test_a_paused_sequence_still_copies_a_strong_match_where_strong_matches_pay():
    """A tool call pauses on the values the model writes, then copies a repeated object."""
    cfg = SpeculationConfig(num_draft_tokens=4, min_match=2, strong_match=6, min_acceptance=0.3,
                            retry_after=50)
    for strong_chance, copies in ((0.9, True), (0.3, False)):
        estimates = {k: Acceptance(weight=0.0) for k in KINDS}
        estimates["strong"] = Acceptance(strong_chance, 1 - strong_chance, weight=0.0)
        d = NgramDrafter(cfg, estimates=estimates)
        toks = [1, 2, 3, 50, 60, 1, 2, 3]  # a weak (3-token) match, missed until paused
        while d.propose(toks, 4):
            d.observe(2, 0, len(toks))
        assert d.propose(toks, 4) == []  # paused: weak matches wait for the retry
        toks += [10, 11, 12, 13, 14, 15, 16, 17, 70, 10, 11, 12, 13, 14, 15, 16]
        assert d.propose(toks, 4) == ([17, 70, 10, 11] if copies else [])
        if copies:
            assert d.kind == "strong"


# -- the scheduler and core ---------------------------------------------------------------
def test_speculative_output_equals_plain_output_with_fewer_steps():
    core, runner = make()
    seqs = [make_seq(i, prompt=code_prompt(i), max_tokens=40, ignore_eos=True) for i in range(6)]
    for s in seqs:
        core.add(s)
    outs = drain(core)
    for s in seqs:
        assert streamed(outs, s.seq_id) == reference_output(s.prompt_token_ids, 40, copying_token)
        assert s.output_token_ids == streamed(outs, s.seq_id)
        final = next(o for o in outs if o.seq_id == s.seq_id and o.finished).final
        assert final.completion_tokens == 40  # drafts are never billed
    drafted = [c for b in runner.batches for c in b.chunks if c.num_draft_tokens]
    assert drafted and sum(s.drafter.accepted for s in seqs) > 0
    for s in seqs:  # some steps yielded several tokens
        assert sum(1 for b in runner.batches for c in b.chunks if c.seq_id == s.seq_id and c.sample) < 40
    assert core.scheduler.blocks.num_free_blocks == 128


def test_opted_out_and_speculating_sequences_share_steps():
    core, runner = make()
    a = make_seq(1, prompt=code_prompt(1), max_tokens=30, ignore_eos=True)
    b = make_seq(2, prompt=code_prompt(1), max_tokens=30, ignore_eos=True, speculation=False)
    core.add(a)
    core.add(b)
    outs = drain(core)
    ref = reference_output(a.prompt_token_ids, 30, copying_token)
    assert streamed(outs, 1) == ref and streamed(outs, 2) == ref
    mixed = [bt for bt in runner.batches
             if {c.seq_id: c.num_draft_tokens for c in bt.chunks}.get(1) and 2 in
             {c.seq_id for c in bt.chunks}]
    assert mixed  # one step verified a's drafts beside b's plain decode
    assert all(c.num_draft_tokens == 0 for bt in runner.batches for c in bt.chunks if c.seq_id == 2)


def test_engine_switch_off_never_drafts():
    core, runner = make(spec=SpeculationConfig(enabled=False))
    s = make_seq(1, prompt=code_prompt(3), max_tokens=20, ignore_eos=True)
    core.add(s)
    drain(core)
    assert all(c.num_draft_tokens == 0 for b in runner.batches for c in b.chunks)
    assert s.output_token_ids == reference_output(s.prompt_token_ids, 20, copying_token)


def test_with_a_row_tile_drafts_fill_only_the_free_rows_of_the_last_tile():
    """A runner that multiplies decode rows 4 at a time (row_tile=4): 3 decodes leave room for
    one draft token, 4 for none, 5 for three; the outputs are the plain ones. Without the tile
    the same requests draft past it."""
    def run(tile):
        core, runner = make(spec=SpeculationConfig(num_draft_tokens=6, max_draft_tokens_per_step=24,
                                                   row_tile=tile))
        seqs = [make_seq(i, prompt=code_prompt(20 + i, 48), max_tokens=40, ignore_eos=True) for i in range(5)]
        for s in seqs:
            core.add(s)
        drain(core)
        for s in seqs:
            assert s.output_token_ids == reference_output(s.prompt_token_ids, 40, copying_token)
        steps = []
        for b in runner.batches:
            decodes = [c for c in b.chunks if c.sample and len(c.token_ids) == 1 + c.num_draft_tokens
                       and c.output_token_ids]
            steps.append((len(decodes), sum(c.num_draft_tokens for c in b.chunks)))
        return steps

    tiled = run(4)
    assert any(d for _, d in tiled)  # drafts still verified in the free rows
    for rows, drafts in tiled:
        assert drafts <= -(-rows // 4) * 4 - rows, (rows, drafts)
    assert any(drafts > -(-rows // 4) * 4 - rows for rows, drafts in run(0))
    with pytest.raises(ValueError, match="row_tile"):
        SpeculationConfig(row_tile=-1)


def test_rejected_drafts_free_their_blocks_and_every_step_keeps_the_budget():
    core, runner = make(num_blocks=64, max_num_batched_tokens=32)
    sched, blocks = core.scheduler, core.scheduler.blocks
    seqs = [make_seq(i, prompt=code_prompt(10 + i, 30), max_tokens=60, ignore_eos=True)
            for i in range(4)]
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
        batch = runner.batches[-1]
        assert batch.num_tokens <= 32
        assert sum(c.num_draft_tokens for c in batch.chunks) <= SPEC.max_draft_tokens_per_step
        for s in sched.running:
            if s.output_token_ids and s.num_remaining == 1:  # decoding: no block past its end
                assert len(s.block_table) <= blocks.blocks_needed(s.num_tokens)
    assert blocks.num_free_blocks == 64
    for s in seqs:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, 60, copying_token)


def test_prefix_cache_stays_correct_after_speculative_steps():
    core, runner = make(block_size=4)
    first = make_seq(1, prompt=code_prompt(5, 48), max_tokens=30, ignore_eos=True)
    core.add(first)
    drain(core)
    # A second request whose prompt is the first one's prompt + output hits blocks that
    # speculative steps filled: the fake runner reads and checks every one of them.
    again = make_seq(2, prompt=first.prompt_token_ids + first.output_token_ids, max_tokens=20,
                     ignore_eos=True)
    core.add(again)
    drain(core)
    assert again.num_cached_tokens > 48
    assert again.output_token_ids == reference_output(again.prompt_token_ids, 20, copying_token)


def test_preemption_with_drafts_recomputes_exactly():
    core, runner = make(num_blocks=28, block_size=4, max_num_seqs=4)
    seqs = [make_seq(i, prompt=code_prompt(20 + i, 24), max_tokens=50, ignore_eos=True,
                     priority=i % 2) for i in range(4)]
    for s in seqs:
        core.add(s)
    drain(core)
    assert core.scheduler.num_preemptions > 0
    for s in seqs:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, 50, copying_token)
    assert core.scheduler.blocks.num_free_blocks == 28


def test_eos_inside_accepted_drafts_ends_there():
    prompt = code_prompt(7, 36)
    ref = reference_output(prompt, 40, copying_token)
    stop_at = next(i for i in range(8, 40) if ref[i] in prompt)  # a token drafts can reach
    core, runner = make()
    s = make_seq(1, prompt=prompt, max_tokens=100, ignore_eos=True, stop_ids=(ref[stop_at],))
    core.add(s)
    outs = drain(core)
    first = ref.index(ref[stop_at])
    assert streamed(outs, 1) == ref[:first + 1]
    assert outs[-1].finish_reason is FinishReason.STOP
    assert outs[-1].final.completion_tokens == first + 1


def test_stop_string_inside_accepted_drafts_drops_the_tokens_after_it():
    prompt = code_prompt(8, 36)
    ref = reference_output(prompt, 40, copying_token)
    core, runner = make()
    i = 20
    s = make_seq(1, prompt=prompt, max_tokens=100, ignore_eos=True, stop=(f"w{ref[i]} w{ref[i + 1]} ",))
    core.add(s)
    outs = drain(core)
    first = next(j for j in range(39) if ref[j:j + 2] == ref[i:i + 2])
    text = "".join(o.text for o in outs)
    assert text == "".join(f"w{t} " for t in ref[:first])
    assert s.output_token_ids == ref[:first + 2]
    assert outs[-1].final.completion_tokens == first + 2


def test_max_tokens_and_context_are_never_passed():
    core, runner = make(max_model_len=70)
    a = make_seq(1, prompt=code_prompt(9, 36), max_tokens=13, ignore_eos=True)
    b = make_seq(2, prompt=code_prompt(9, 36), max_tokens=100, ignore_eos=True)
    core.add(a)
    core.add(b)
    outs = drain(core)
    assert len(streamed(outs, 1)) == 13 and len(streamed(outs, 2)) == 70 - 36
    assert all(c.start_pos + len(c.token_ids) <= 70 for bt in runner.batches for c in bt.chunks)


def test_nothing_to_copy_stops_drafting():
    """A model that never says what the prompt said: drafts miss, the sequence pauses them."""
    core, runner = make(model=next_token)
    s = make_seq(1, prompt=code_prompt(11, 60), max_tokens=200, ignore_eos=True)
    core.add(s)
    drain(core)
    drafted = [c for b in runner.batches for c in b.chunks if c.num_draft_tokens]
    assert s.drafter.accepted == 0
    assert s.drafter.proposed <= 6 * 2 * 4  # a few probes, not one per step
    assert len(drafted) < len(runner.batches) // 4


@pytest.mark.parametrize("spec", [SPEC, SpeculationConfig(enabled=False)])
def test_cancelling_100_speculating_streams_returns_every_block(spec):
    rng = random.Random(11)
    core, runner = make(num_blocks=96, block_size=4, spec=spec, max_num_seqs=12,
                        max_num_batched_tokens=48)
    initial = core.scheduler.blocks.num_free_blocks
    shared = code_prompt(1, 30)
    for i in range(100):
        prompt = shared + [i] * rng.randint(0, 20) if i % 3 == 0 else code_prompt(i, rng.randint(6, 40))
        core.add(make_seq(i, prompt=prompt, max_tokens=1000, ignore_eos=True))
    live = set(range(100))
    while core.has_work():
        core.step()
        for sid in sorted(live):
            if rng.random() < 0.1:
                assert core.abort(sid).finish_reason is FinishReason.CANCELLED
                live.discard(sid)
    assert not live
    assert core.scheduler.blocks.num_free_blocks == initial
    if spec.enabled:
        assert any(c.num_draft_tokens for b in runner.batches for c in b.chunks)


def test_metrics_count_drafts_and_tokens_per_step():
    from prometheus_client import REGISTRY

    from services.engine.metrics import EngineMetrics

    def value(name):
        return REGISTRY.get_sample_value(name) or 0.0

    names = ("tokenserve_engine_draft_tokens_proposed_total",
             "tokenserve_engine_draft_tokens_accepted_total",
             "tokenserve_engine_draft_acceptance_rate_count",
             "tokenserve_engine_tokens_per_step_sum", "tokenserve_engine_generated_tokens_total")
    before = {n: value(n) for n in names}
    core, runner = make()
    core.observer = EngineMetrics()
    s = make_seq(1, prompt=code_prompt(4), max_tokens=40, ignore_eos=True)
    core.add(s)
    drain(core)
    delta = {n: value(n) - before[n] for n in names}
    assert delta["tokenserve_engine_draft_tokens_proposed_total"] == s.drafter.proposed > 0
    assert delta["tokenserve_engine_draft_tokens_accepted_total"] == s.drafter.accepted > 0
    assert delta["tokenserve_engine_draft_acceptance_rate_count"] == 1
    assert delta["tokenserve_engine_generated_tokens_total"] == 40
    assert delta["tokenserve_engine_tokens_per_step_sum"] == 39  # all but the first token
