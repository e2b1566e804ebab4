"""Scheduler: token budget, chunked prefill, stop rules, priorities, fairness, preemption."""
from __future__ import annotations

import pytest

from services.engine.block_manager import BlockManager
from services.engine.scheduler import MIN_PREFILL_CHUNK, Scheduler, SchedulerConfig, StepCosts
from services.engine.sequence import FinishReason, SeqStatus
from tests.unit.engine_core.fakes import EOS, FakeRunner, make_seq, reference_output


def make(num_blocks=64, block_size=4, **cfg):
    cfg.setdefault("max_num_seqs", 8)
    cfg.setdefault("max_num_batched_tokens", 32)
    cfg.setdefault("max_model_len", 4096)
    sched = Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size), {EOS})
    return sched, FakeRunner(num_blocks, block_size)


def step(sched, runner):
    batch = sched.schedule()
    out = runner.execute(batch)
    sched.update(batch, out)
    return batch


def run_all(sched, runner, limit=10_000):
    for _ in range(limit):
        if not sched.has_work():
            return
        step(sched, runner)
    raise AssertionError("scheduler did not finish")


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="itl_target_s"):
        SchedulerConfig(itl_target_s=-1)
    with pytest.raises(ValueError, match="burst_hold_s"):
        SchedulerConfig(burst_hold_s=float("nan"))
    with pytest.raises(ValueError, match="prompt_wait_s"):
        SchedulerConfig(prompt_wait_s=-1)


def test_every_step_respects_budget_and_slots():
    sched, runner = make(max_num_seqs=3, max_num_batched_tokens=16)
    seqs = [make_seq(i, 5 + 7 * i, max_tokens=5) for i in range(8)]
    for s in seqs:
        sched.add(s)
    for _ in range(500):
        if not sched.has_work():
            break
        batch = step(sched, runner)
        assert batch.num_tokens <= 16
        assert len(batch.chunks) <= 3
    assert not sched.has_work()
    for s in seqs:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, 5)
        assert s.finish_reason is FinishReason.LENGTH


def test_long_prompt_is_chunked_and_never_stalls_running_decodes():
    sched, runner = make(max_num_batched_tokens=16)
    short = make_seq(1, 3, max_tokens=100)
    sched.add(short)
    step(sched, runner)
    assert short.output_token_ids  # decoding now
    long = make_seq(2, 200, max_tokens=2)
    sched.add(long)
    while long.num_computed_tokens < 200:
        batch = step(sched, runner)
        ids = [c.seq_id for c in batch.chunks]
        assert ids[0] == 1 and len(batch.chunks[0].token_ids) == 1  # decode first, every step
        assert batch.num_tokens <= 16
    assert long.output_token_ids == reference_output(long.prompt_token_ids, 1)


def test_itl_target_limits_prompt_tokens_beside_decodes():
    """Steps cost 60 ms of decodes plus 1 ms per prompt token: with a 100 ms target a prompt
    arriving while others decode goes in 40-token chunks, not the whole 256 budget."""
    sched, runner = make(num_blocks=512, max_num_batched_tokens=256, itl_target_s=0.1)
    runner.cost = lambda decode_rows, prompt_tokens: (0.06 if decode_rows else 0.0) + 0.001 * prompt_tokens
    first = make_seq(1, 100, max_tokens=200)
    sched.add(first)
    assert step(sched, runner).num_tokens == 100  # nothing decoding: the whole prompt at once
    step(sched, runner)  # a decode-only step: its cost is learned
    late = make_seq(2, 300, max_tokens=2)
    sched.add(late)
    chunks = []
    while late.num_computed_tokens < 300:
        batch = step(sched, runner)
        assert batch.chunks[0].seq_id == 1  # the decode is never skipped
        chunks += [len(c.token_ids) for c in batch.chunks if c.seq_id == 2]
    assert chunks == [40] * 7 + [20]
    assert late.output_token_ids == reference_output(late.prompt_token_ids, 1)


def late_prompt_chunks(sched, runner, prompt_len: int) -> list[int]:
    """Starts one decoding sequence, then adds a prompt of prompt_len tokens; the chunk sizes
    that prompt is prefilled in."""
    sched.add(make_seq(1, 10, max_tokens=500))
    step(sched, runner)
    step(sched, runner)
    late = make_seq(2, prompt_len, max_tokens=1)
    sched.add(late)
    sizes = []
    while not late.finished:
        batch = step(sched, runner)
        sizes += [len(c.token_ids) for c in batch.chunks if c.seq_id == 2]
    return sizes


def test_itl_target_never_starves_prompts():
    """Decodes alone (200 ms) over the 50 ms target: prompts still get half as long as the
    decodes, 100 tokens at 1 ms each, every step."""
    sched, runner = make(num_blocks=512, max_num_batched_tokens=256, itl_target_s=0.05)
    runner.cost = lambda decode_rows, prompt_tokens: (0.2 if decode_rows else 0.0) + 0.001 * prompt_tokens
    assert late_prompt_chunks(sched, runner, 450) == [100, 100, 100, 100, 50]


def test_itl_target_gives_prompts_at_least_a_minimum_chunk():
    sched, runner = make(num_blocks=512, max_num_batched_tokens=256, itl_target_s=0.05)
    runner.cost = lambda decode_rows, prompt_tokens: (0.04 if decode_rows else 0.0) + 0.01 * prompt_tokens
    assert late_prompt_chunks(sched, runner, 100) == [MIN_PREFILL_CHUNK] * 3 + [100 - 3 * MIN_PREFILL_CHUNK]


def test_a_prompt_kept_waiting_lifts_the_itl_target():
    """Decodes take 60 ms, prompt tokens 1 ms: under the 100 ms target a late prompt goes in
    40-token chunks, until it has waited prompt_wait_s (0.3 s): then the rest in one step."""
    sched, runner = make(num_blocks=512, max_num_batched_tokens=256, itl_target_s=0.1, prompt_wait_s=0.3)
    runner.cost = lambda decode_rows, prompt_tokens: (0.06 if decode_rows else 0.0) + 0.001 * prompt_tokens
    clock = 0.0
    sched.add(make_seq(1, 10, max_tokens=500, arrival=clock))
    late = None
    sizes = []
    steps = 0
    while late is None or not late.output_token_ids:
        if steps == 2:  # the first prompt, then a decode-only step: both costs are learned
            late = make_seq(2, 300, max_tokens=2, arrival=clock)
            sched.add(late)
        steps += 1
        batch = sched.schedule(clock)
        out = runner.execute(batch)
        sched.update(batch, out)
        clock += out.seconds
        sizes += [len(c.token_ids) for c in batch.chunks if c.seq_id == 2]
    # 0.1 s steps: 40 tokens a step while the prompt waits < 0.3 s, then all 180 left at once
    assert sizes == [40, 40, 40, 180]
    assert late.output_token_ids == reference_output(late.prompt_token_ids, 1)


def test_without_decodes_or_target_the_budget_is_the_only_limit():
    sched, runner = make(num_blocks=512, max_num_batched_tokens=64)
    runner.cost = lambda decode_rows, prompt_tokens: 1.0
    sched.add(make_seq(1, 10, max_tokens=50))
    step(sched, runner)
    step(sched, runner)
    sched.add(make_seq(2, 300, max_tokens=1))
    assert step(sched, runner).num_tokens == 64  # 1 decode + 63 prompt tokens


def test_step_costs_learn_from_timings():
    c = StepCosts()
    assert c.prompt_tokens_within(0.1) is None
    c.observe(decode_rows=0, prompt_tokens=100, seconds=0.2)  # prompt only: 2 ms a token
    assert c.prompt_tokens_within(0.1) is None  # decode cost still unknown
    c.observe(decode_rows=8, prompt_tokens=0, seconds=0.05)
    assert c.prompt_tokens_within(0.1) == 25
    assert c.prompt_tokens_within(0.01) == 12  # over the target: half a decode step of prompt
    c.observe(decode_rows=8, prompt_tokens=10, seconds=0.0)  # no timing: ignored
    assert c.prompt_tokens_within(0.1) == 25


def test_stop_on_eos_unless_ignored_and_on_stop_token_ids():
    sched, runner = make()
    a, b, c = make_seq(1, max_tokens=10), make_seq(2, max_tokens=3, ignore_eos=True), \
        make_seq(3, max_tokens=10, stop_ids=[42])
    runner.script = {1: [5, EOS, 6], 2: [EOS, EOS], 3: [7, 42]}
    for s in (a, b, c):
        sched.add(s)
    run_all(sched, runner)
    assert a.output_token_ids == [5, EOS] and a.finish_reason is FinishReason.STOP
    assert len(b.output_token_ids) == 3 and b.finish_reason is FinishReason.LENGTH
    assert c.output_token_ids == [7, 42] and c.finish_reason is FinishReason.STOP


def test_stops_when_the_context_is_full():
    sched, runner = make(max_model_len=12)
    s = make_seq(1, 10, max_tokens=50)
    sched.add(s)
    run_all(sched, runner)
    assert s.num_tokens == 12 and s.finish_reason is FinishReason.LENGTH


def test_higher_priority_is_admitted_first():
    sched, runner = make(max_num_seqs=1)
    low, high = make_seq(1, priority=0, max_tokens=2), make_seq(2, priority=5, max_tokens=2)
    sched.add(low)
    sched.add(high)
    batch = step(sched, runner)
    assert [c.seq_id for c in batch.chunks] == [2]


def test_higher_priority_takes_a_full_batch_slot_from_the_lowest_and_youngest():
    sched, runner = make(max_num_seqs=3)
    old_low = make_seq(1, priority=0, max_tokens=20, arrival=1.0)
    young_low = make_seq(2, priority=0, max_tokens=20, arrival=2.0)
    mid = make_seq(3, priority=1, max_tokens=20, arrival=3.0)
    for s in (old_low, young_low, mid):
        sched.add(s)
    for _ in range(3):
        step(sched, runner)
    assert sched.num_running == 3 and young_low.output_token_ids
    high = make_seq(4, priority=5, max_tokens=4, arrival=4.0)
    sched.add(high)
    batch = step(sched, runner)
    # the new arrival computes in the very next step, in the slot of the youngest lowest
    assert 4 in {c.seq_id for c in batch.chunks}
    assert young_low.status is SeqStatus.WAITING and young_low.num_preemptions == 1
    assert old_low.status is SeqStatus.RUNNING and mid.status is SeqStatus.RUNNING
    run_all(sched, runner)
    for s in (old_low, young_low, mid, high):  # the preempted one is recomputed exactly
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.stop.max_tokens)
    assert sched.blocks.num_free_blocks == 64


def test_lower_priority_waits_while_higher_priorities_hold_every_slot():
    sched, runner = make(max_num_seqs=2)
    for i in range(2):
        sched.add(make_seq(i, priority=2, tenant=f"p{i}", max_tokens=4))
    step(sched, runner)
    low = make_seq(9, priority=0, tenant="free", max_tokens=2)
    sched.add(low)
    batch = step(sched, runner)
    assert {c.seq_id for c in batch.chunks} == {0, 1} and low.status is SeqStatus.WAITING
    run_all(sched, runner)
    assert low.output_token_ids == reference_output(low.prompt_token_ids, 2)


def test_a_waiting_sequence_never_displaces_one_of_its_own_priority():
    sched, runner = make(max_num_seqs=2)
    running = [make_seq(i, priority=1, tenant=f"t{i}", max_tokens=10) for i in range(2)]
    for s in running:
        sched.add(s)
    step(sched, runner)
    late = make_seq(9, priority=1, tenant="t9", max_tokens=2)
    sched.add(late)
    batch = step(sched, runner)
    assert {c.seq_id for c in batch.chunks} == {0, 1} and sched.num_preemptions == 0


def test_no_tenant_starves_another_of_the_same_priority():
    sched, runner = make(max_num_seqs=2)
    for i in range(20):
        sched.add(make_seq(i, tenant="big", max_tokens=3))
    late = [make_seq(100 + i, tenant="small", max_tokens=3) for i in range(2)]
    for s in late:
        sched.add(s)
    order = []
    while sched.has_work():
        batch = step(sched, runner)
        for c in batch.chunks:
            if c.start_pos == 0:
                order.append(c.seq_id)
    # big gets both slots first; as slots free up, small (fewer running) gets one each time
    assert order.index(100) <= 3 and order.index(101) <= 5
    assert set(order) == set(range(20)) | {100, 101}


def test_low_priority_is_preempted_when_blocks_run_out_and_recomputed_exactly():
    # 8 blocks of 4 = 32 positions; two sequences of 12 + 12 tokens need 6+ blocks each
    sched, runner = make(num_blocks=8, max_num_seqs=4, max_num_batched_tokens=32)
    low = make_seq(1, 10, max_tokens=12, priority=0)
    high = make_seq(2, 10, max_tokens=12, priority=1, arrival=5.0)
    sched.add(low)
    sched.add(high)
    preempted_low = False
    while sched.has_work():
        step(sched, runner)
        preempted_low |= low.status is SeqStatus.WAITING and low.num_preemptions > 0
        assert high.num_preemptions == 0
    assert preempted_low and sched.num_preemptions >= 1
    assert high.output_token_ids == reference_output(high.prompt_token_ids, 12)
    assert low.output_token_ids == reference_output(low.prompt_token_ids, 12)
    assert sched.blocks.num_free_blocks == 8


def test_finish_frees_blocks_and_tells_the_runner():
    sched, runner = make()
    s = make_seq(1, 30, max_tokens=50)
    other = make_seq(2, 5, max_tokens=50)
    sched.add(s)
    sched.add(other)
    step(sched, runner)
    used = sched.blocks.num_used_blocks
    sched.finish(s, FinishReason.CANCELLED)
    assert sched.blocks.num_used_blocks < used and s.block_table == []
    step(sched, runner)
    assert 1 in runner.finished_seen


def test_prefix_cache_hit_is_reported_and_output_unchanged():
    sched, runner = make()
    prompt = list(range(1, 40))
    first = make_seq(1, prompt=prompt, max_tokens=4)
    sched.add(first)
    run_all(sched, runner)
    second = make_seq(2, prompt=prompt + [5, 6], max_tokens=4)
    sched.add(second)
    run_all(sched, runner)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 36  # 9 full blocks of 4
    assert second.output_token_ids == reference_output(second.prompt_token_ids, 4)


def test_admission_keeps_a_reserve_for_running_sequences_to_grow():
    sched, runner = make(num_blocks=6, admission_reserve_blocks=2, max_num_batched_tokens=32)
    a, b = make_seq(1, 8, max_tokens=2), make_seq(2, 12, max_tokens=2)
    sched.add(a)
    sched.add(b)
    batch = step(sched, runner)
    # a takes 2 blocks (idle engine: no reserve); b needs 3 more but only 4 are free - 2 kept
    assert [c.seq_id for c in batch.chunks] == [1]
    run_all(sched, runner)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 2)


def first_token_steps(sched, runner, seqs, *, step_s=None) -> dict[int, int]:
    """Runs to the end (the clock advancing by each step's reported seconds, or step_s);
    the step index at which each sequence got its first token."""
    for s in seqs:
        sched.add(s)
    first, now = {}, 0.0
    for i in range(10_000):
        if not sched.has_work():
            return first
        batch = sched.schedule(now)
        out = runner.execute(batch)
        now += out.seconds if step_s is None else step_s
        sched.update(batch, out, now)
        for s in seqs:
            if s.output_token_ids and s.seq_id not in first:
                first[s.seq_id] = i
    raise AssertionError("scheduler did not finish")


def bursty(**cfg):
    """1 ms per prompt token; one request already served so the cost is known."""
    cfg.setdefault("max_num_batched_tokens", 32)
    sched, runner = make(num_blocks=512, itl_target_s=0.1, **cfg)
    runner.cost = lambda decode_rows, prompt_tokens: 0.001 * (decode_rows + prompt_tokens)
    first_token_steps(sched, runner, [make_seq(100, 10, max_tokens=2)])
    return sched, runner


def test_a_burst_starts_streaming_together_and_output_is_unchanged():
    sched, runner = bursty(burst_hold_s=1.0)
    seqs = [make_seq(i, 20, max_tokens=6) for i in range(1, 9)]  # 160 prompt tokens
    start = len(runner.batches)
    first = first_token_steps(sched, runner, seqs)
    # every first token in the 5th step; the burst was prefilled in full 32-token steps
    assert first == {s.seq_id: 4 for s in seqs}
    assert [b.num_tokens for b in runner.batches[start:start + 5]] == [32] * 5
    for s in seqs:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, 6)


def test_without_a_hold_a_burst_starts_one_prompt_at_a_time():
    sched, runner = bursty(burst_hold_s=0.0)
    seqs = [make_seq(i, 20, max_tokens=6) for i in range(1, 9)]
    assert len(set(first_token_steps(sched, runner, seqs).values())) > 1


def test_a_lone_prompt_is_never_held():
    sched, runner = bursty(burst_hold_s=1.0)
    seq = make_seq(1, 100, max_tokens=2)
    # 100 tokens in chunks of 32: the first token comes with the 4th step, as without a hold
    assert first_token_steps(sched, runner, [seq]) == {1: 3}
    assert [len(c.token_ids) for b in runner.batches[-5:-1] for c in b.chunks] == [32, 32, 32, 4]


def test_a_burst_expected_to_take_longer_than_the_hold_is_not_held():
    sched, runner = bursty(burst_hold_s=0.1)  # 160 tokens at 1 ms: 0.16 s
    seqs = [make_seq(i, 20, max_tokens=6) for i in range(1, 9)]
    first = first_token_steps(sched, runner, seqs)
    assert first[1] == 0 and len(set(first.values())) > 1


def test_a_hold_ends_when_it_has_lasted_burst_hold_s():
    """The steps take 4x longer than learned: after the first (0.128 s), the rest of the
    burst (0.128 s more expected) would end past 0.2 s, so the held prompt is released in
    the next step rather than kept until the burst is done."""
    sched, runner = bursty(burst_hold_s=0.2)
    seqs = [make_seq(i, 20, max_tokens=6) for i in range(1, 9)]  # 0.16 s expected
    first = first_token_steps(sched, runner, seqs, step_s=0.128)  # 32 tokens x 4 ms
    assert first[1] == 1  # held back in step 0, released in step 1
    assert len(set(first.values())) > 1


def test_prompts_arriving_while_others_stream_are_not_held():
    sched, runner = bursty(burst_hold_s=1.0)
    streaming = make_seq(1, 5, max_tokens=100)
    sched.add(streaming)
    step(sched, runner)
    assert streaming.output_token_ids
    late = [make_seq(i, 20, max_tokens=2) for i in range(2, 6)]
    first = first_token_steps(sched, runner, late)
    assert len(set(first.values())) > 1


def test_a_prompt_is_never_held_for_lower_priority_prompts():
    sched, runner = bursty(burst_hold_s=1.0)
    urgent = make_seq(1, 20, max_tokens=2, priority=1)
    rest = [make_seq(i, 20, max_tokens=2) for i in range(2, 9)]
    # its whole prompt goes in the first step and its first token comes with it
    assert first_token_steps(sched, runner, [urgent, *rest])[1] == 0


def test_another_tenants_lone_request_is_never_held_for_a_burst():
    sched, runner = bursty(burst_hold_s=1.0)
    flood = [make_seq(i, 20, max_tokens=6, tenant="flood") for i in range(1, 9)]
    light = make_seq(50, 20, max_tokens=6, tenant="light", arrival=0.5)
    first = first_token_steps(sched, runner, [*flood, light])
    # fair share admits the light tenant first; its first token comes with its prefill
    assert first[50] == 0
    assert min(first[s.seq_id] for s in flood) > 0
    for s in (*flood, light):
        assert s.output_token_ids == reference_output(s.prompt_token_ids, 6)


def streaming_flood(n=6):
    """bursty() with `n` sequences of tenant 'flood' decoding (1 ms per row and per prompt
    token: a decode step of 6 rows costs 6 ms)."""
    sched, runner = bursty(burst_hold_s=0.0)
    flood = [make_seq(i, 4, max_tokens=60, tenant="flood") for i in range(1, n + 1)]
    for s in flood:
        sched.add(s)
    while not all(s.output_token_ids for s in flood):
        step(sched, runner)
    for _ in range(20):  # decode-only steps: their cost is learned
        step(sched, runner)
    return sched, runner, flood


def test_a_newcomer_tenants_prompt_gets_a_step_of_its_own_while_others_decode():
    sched, runner, flood = streaming_flood()
    light = make_seq(50, 3, max_tokens=4, tenant="light")
    sched.add(light)
    batch = step(sched, runner)
    # its 3 prompt tokens (3 ms) alone, not beside the 6 decodes (6 ms): first token at once
    assert [c.seq_id for c in batch.chunks] == [50] and light.output_token_ids
    batch = step(sched, runner)  # then everyone decodes together
    assert {c.seq_id for c in batch.chunks} == {50, *(s.seq_id for s in flood)}
    run_all(sched, runner)
    for s in (*flood, light):
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.stop.max_tokens)


def test_decodes_never_wait_two_newcomer_steps_in_a_row():
    sched, runner, flood = streaming_flood()
    decoded_at = []
    for i in range(6):
        sched.add(make_seq(60 + i, 3, max_tokens=2, tenant=f"new{i}"))
        batch = step(sched, runner)
        decoded_at.append(any(c.seq_id == flood[0].seq_id for c in batch.chunks))
    assert decoded_at.count(False) <= 3 and all(a or b for a, b in zip(decoded_at, decoded_at[1:]))


def test_no_newcomer_step_when_the_prompt_costs_more_than_the_decodes():
    sched, runner, flood = streaming_flood(n=2)  # 2 ms of decodes
    light = make_seq(50, 20, max_tokens=4, tenant="light")  # 20 ms of prompt
    sched.add(light)
    batch = step(sched, runner)
    assert {s.seq_id for s in flood} <= {c.seq_id for c in batch.chunks}


def test_a_newcomers_cached_prefix_costs_nothing_in_the_choice_of_its_own_step():
    sched, runner, flood = streaming_flood()  # 6 ms of decodes
    prompt = [(7 * i) % 500 + 3 for i in range(20)]  # 20 ms of prompt, uncached
    earlier = make_seq(50, prompt=prompt, max_tokens=2, tenant="light")
    sched.add(earlier)
    batch = step(sched, runner)
    assert {s.seq_id for s in flood} <= {c.seq_id for c in batch.chunks}  # beside the decodes
    while not earlier.finished:
        step(sched, runner)
    # the same prompt again: 16 of its 20 tokens are cached, 4 ms left to compute
    later = make_seq(51, prompt=prompt, max_tokens=2, tenant="light")
    sched.add(later)
    batch = step(sched, runner)
    assert [c.seq_id for c in batch.chunks] == [51] and later.output_token_ids
    run_all(sched, runner)
    assert later.output_token_ids == reference_output(prompt, 2)


def test_a_tenant_holding_every_slot_gives_one_up_to_a_waiting_tenant():
    sched, runner = make(max_num_seqs=4)
    flood = [make_seq(i, tenant="flood", max_tokens=50) for i in range(4)]
    for s in flood:
        sched.add(s)
    for _ in range(3):
        step(sched, runner)
    assert [s.seq_id for s in sched.running] == [0, 1, 2, 3]
    light = make_seq(100, tenant="light", max_tokens=3)
    sched.add(light)
    batch = step(sched, runner)
    # the flood's youngest stream waits (recomputed later); the light tenant starts at once
    assert 100 in [c.seq_id for c in batch.chunks] and flood[3].num_preemptions == 1
    assert sorted(s.seq_id for s in sched.running) == [0, 1, 2, 100]
    run_all(sched, runner)
    for s in flood + [light]:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.stop.max_tokens)


def test_a_tenant_within_its_share_keeps_its_slots():
    sched, runner = make(max_num_seqs=4)
    for i in range(2):
        sched.add(make_seq(i, tenant="a", max_tokens=50))
        sched.add(make_seq(10 + i, tenant="b", max_tokens=50))
    for _ in range(3):
        step(sched, runner)
    sched.add(make_seq(20, tenant="b", max_tokens=3))  # b already has its share of 2
    step(sched, runner)
    assert sched.num_preemptions == 0 and sched.num_waiting == 1
