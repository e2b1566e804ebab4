"""Interjected steps (the CPU's plain order): a newcomer that arrives while another tenant's
batch is being computed gets its prompt computed between two of that step's layers and its
first token streamed before the step ends. Everyone's tokens stay exactly what they would
be otherwise."""
from __future__ import annotations

import asyncio

from services.engine.engine_loop import AsyncEngine
from services.engine.sequence import FinishReason
from tests.unit.engine_core.fakes import make_seq, reference_output
from tests.unit.engine_core.test_engine_core import Clock, Joules, drain, make_core


class Arrivals:
    """Interjections: hands the core `incoming` between the layers of the next step it runs,
    records what is delivered early and when."""

    def __init__(self, core, runner):
        self.core, self.runner = core, runner
        self.incoming = []
        self.delivered = []  # (runner batches executed so far, outputs)

    def take_new(self):
        if not self.incoming:
            return False
        for s in self.incoming:
            self.core.add(s)
        self.incoming = []
        return True

    def deliver_now(self, outputs):
        self.delivered.append((len(self.runner.batches), outputs))


def flooded_core(**kw):
    core, runner = make_core(max_num_seqs=16, budget=64, clock=Clock(), **kw)
    # steps cost by their rows: decodes 10 ms + 5 ms a row, prompts 1 ms a token
    runner.cost = lambda rows, prompt: 0.01 + 0.005 * rows + 0.001 * prompt
    arrivals = core.interjections = Arrivals(core, runner)
    flood = [make_seq(i, 6, tenant="flood", max_tokens=12) for i in range(8)]
    for s in flood:
        core.add(s)
    first = []
    for _ in range(3):  # prompts, then decodes: the costs are learned
        first += core.step()
    return core, runner, arrivals, flood, first


def test_a_newcomer_arriving_mid_step_streams_its_first_token_before_the_step_ends():
    core, runner, arrivals, flood, first = flooded_core()
    light = make_seq(100, 5, tenant="light", max_tokens=6)
    arrivals.incoming = [light]
    steps_before = len(runner.batches)
    outs = core.step()  # the flood's decode step; light arrives after its first layer
    # light's prompt ran as a step of its own inside that one, and its first token went out
    [(executed, early)] = arrivals.delivered
    assert executed == steps_before + 1  # light's step ran before the flood's batch finished
    assert [b.chunks[0].seq_id for b in runner.batches[steps_before:steps_before + 1]] == [100]
    assert [o.token_ids for o in early] == [reference_output(light.prompt_token_ids, 1)]
    assert all(o.seq_id != 100 for o in outs)
    outs = first + outs + drain(core)
    for s in (*flood, light):
        got = [t for _, os in arrivals.delivered for o in os if o.seq_id == s.seq_id for t in o.token_ids]
        got += [t for o in outs if o.seq_id == s.seq_id for t in o.token_ids]
        assert got == reference_output(s.prompt_token_ids, s.stop.max_tokens)
    assert core.scheduler.blocks.num_free_blocks == 256


def test_a_tenant_already_running_is_not_interjected():
    core, runner, arrivals, _, _ = flooded_core()
    arrivals.incoming = [make_seq(100, 5, tenant="flood", max_tokens=4)]
    core.step()
    assert arrivals.delivered == []


def test_a_light_tenant_with_its_last_request_still_streaming_is_interjected():
    # one request a second beside a flood: the previous one is still streaming when the
    # next arrives, and the next must not wait for the flood's step either
    core, runner, arrivals, flood, first = flooded_core()
    earlier = make_seq(100, 5, tenant="light", max_tokens=8)
    arrivals.incoming = [earlier]
    core.step()
    assert len(arrivals.delivered) == 1 and earlier.output_token_ids
    later = make_seq(101, 5, tenant="light", max_tokens=4)
    arrivals.incoming = [later]
    core.step()
    [_, (_, early)] = arrivals.delivered
    assert [o.seq_id for o in early] == [101]
    drain(core)
    assert later.output_token_ids == reference_output(later.prompt_token_ids, 4)
    assert core.scheduler.blocks.num_free_blocks == 256


def test_a_tenant_running_half_as_many_as_the_other_is_not_interjected():
    core, runner, arrivals, flood, first = flooded_core()
    others = [make_seq(100 + i, 5, tenant="second", max_tokens=12) for i in range(4)]
    for s in others:
        core.add(s)
    core.step()  # the second tenant's 4 streams beside the flood's 8
    arrivals.incoming = [make_seq(200, 5, tenant="second", max_tokens=4)]
    core.step()
    assert arrivals.delivered == []


def test_the_step_in_progress_is_not_billed_the_interjected_steps_time_or_energy():
    core, runner, arrivals, flood, first = flooded_core(energy=Joules())
    seen = []

    class Observer:
        def on_step(self, core, events, seconds):
            seen.append(({ev.seq.seq_id for ev in events}, seconds))

        def on_finish(self, seq):
            pass

        def gauges(self, scheduler):
            pass

    core.observer = Observer()
    light = make_seq(100, 5, tenant="light", max_tokens=2)
    arrivals.incoming = [light]
    meter = core.energy
    before, flood_before = meter.total, sum(s.energy_joules for s in flood)
    core.step()
    (inner_ids, inner_s), (outer_ids, outer_s) = seen
    assert inner_ids == {100} and 100 not in outer_ids
    # Clock: 10 ms a reading; the outer step's own readings only, not the inner step's
    assert 0 < outer_s < 0.06 and 0 < inner_s < 0.06
    # what the meter counted from the step's first reading to its last, split once: the
    # inner step's joules are not billed to the flood as well
    attributed = sum(s.energy_joules for s in flood) - flood_before + light.energy_joules
    assert light.energy_joules > 0
    assert attributed == meter.total - (before + 2.0)


async def test_cancels_sent_during_a_step_are_applied_after_it_and_end_each_stream_once():
    core, runner = make_core(max_num_seqs=16, budget=64)
    runner.cost = lambda rows, prompt: 0.01 + 0.005 * rows + 0.001 * prompt
    engine = AsyncEngine(lambda: core)
    engine.start()
    await engine.wait_ready()
    try:
        flood = [make_seq(engine.next_seq_id(), 6, tenant="flood", max_tokens=40) for _ in range(6)]
        light = [make_seq(engine.next_seq_id(), 5, tenant=f"light{i}", max_tokens=5) for i in range(4)]

        async def run(s, cancel_after=None):
            got = []
            async for o in engine.generate(s):
                got.extend(o.token_ids)
                if cancel_after is not None and len(got) >= cancel_after:
                    return got, FinishReason.CANCELLED
                if o.finished:
                    return got, o.finish_reason

        tasks = [asyncio.create_task(run(s, 3 if i % 2 else None)) for i, s in enumerate(flood)]
        await asyncio.sleep(0.01)
        for s in light:
            tasks.append(asyncio.create_task(run(s)))
            await asyncio.sleep(0.003)
        results = await asyncio.gather(*tasks)
        for s, (got, reason) in zip((*flood, *light), results):
            n = len(got) if reason is FinishReason.CANCELLED else s.stop.max_tokens
            assert got == reference_output(s.prompt_token_ids, s.stop.max_tokens)[:n]
        for _ in range(100):
            if not core.has_work():
                break
            await asyncio.sleep(0.01)
        assert core.scheduler.blocks.num_free_blocks == 256
    finally:
        engine.stop()


def test_between_layers_the_loop_takes_new_requests_but_holds_cancels_for_the_steps_end():
    """A cancel applied mid-step would free blocks the step in progress still writes (and an
    interjected prompt could be given them): the step loop holds it until the step ends."""
    from services.engine.engine_loop import EngineLoop

    core, _ = make_core()
    running = make_seq(1, 5, max_tokens=50)
    core.add(running)
    core.step()
    delivered = []
    loop = EngineLoop(lambda: core, delivered.extend)
    loop.core = core  # not started: driven by hand on this thread
    newcomer = make_seq(2, 5, tenant="light", max_tokens=3)
    loop.submit(newcomer)
    loop.abort(1)
    assert loop.take_new() is True
    assert core.scheduler.get(2) is newcomer and core.scheduler.get(1) is running
    assert loop.take_new() is False  # nothing new since
    [out] = loop._drain(core)  # the step's end: the held cancel applies
    assert out.seq_id == 1 and out.finish_reason is FinishReason.CANCELLED
    assert core.scheduler.get(1) is None


def test_with_every_slot_taken_the_newcomer_borrows_one_and_the_flood_returns_it_next_step():
    core, runner = make_core(max_num_seqs=4, budget=64, clock=Clock())
    runner.cost = lambda rows, prompt: 0.01 + 0.005 * rows + 0.001 * prompt
    arrivals = core.interjections = Arrivals(core, runner)
    flood = [make_seq(i, 6, tenant="flood", max_tokens=20) for i in range(4)]
    for s in flood:
        core.add(s)
    outs = []
    for _ in range(3):
        outs += core.step()
    light = make_seq(100, 5, tenant="light", max_tokens=4)
    arrivals.incoming = [light]
    outs += core.step()
    [(_, early)] = arrivals.delivered
    assert [o.seq_id for o in early] == [100]  # served inside the full batch's step
    assert core.scheduler.num_running == 5
    outs += core.step()  # the next step gives the slot back: the flood's youngest waits
    assert core.scheduler.num_running == 4 and core.scheduler.get(3).num_preemptions == 1
    assert max(len(b.chunks) for b in runner.batches[-1:]) <= 4
    outs = [o for _, os in arrivals.delivered for o in os] + outs + drain(core)
    for s in (*flood, light):
        assert [t for o in outs if o.seq_id == s.seq_id for t in o.token_ids] == \
            reference_output(s.prompt_token_ids, s.stop.max_tokens)
    assert core.scheduler.blocks.num_free_blocks == 256
