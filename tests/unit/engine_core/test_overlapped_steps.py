"""The overlapped step order (EngineCore overlap=True, the CUDA default): step n is launched
before step n-1's tokens are taken, and cancels and stop strings that arrive meanwhile end
sequences step n already computes. Users must see exactly what the plain order gives them:
the same tokens and text, one final output each, the same billed counts, every block back."""
from __future__ import annotations

import random
import threading

from services.engine.engine_loop import EngineLoop
from services.engine.sequence import FinishReason
from tests.unit.engine_core.fakes import make_seq, reference_output
from tests.unit.engine_core.test_engine_core import Clock, Joules, drain, make_core


def run_overlapped(core, while_in_flight=lambda outs: None, limit=10_000):
    """EngineLoop's overlapped order: launch n, take n-1's outputs, then what arrives while
    the device computes (cancels), expiry, complete n."""
    outs = []
    for _ in range(limit):
        if not core.has_work() and not core.has_outputs():
            return outs
        launched = core.launch() if core.has_work() else None
        outs += core.take_outputs()
        while_in_flight(outs)
        outs += core.expire()
        if launched is not None:
            core.complete(launched)
    raise AssertionError("engine did not finish")


def streamed(outs, seq_id):
    return [t for o in outs if o.seq_id == seq_id for t in o.token_ids]


def finals(outs, seq_id):
    return [o for o in outs if o.seq_id == seq_id and o.final is not None]


def test_overlapped_streams_equal_the_plain_order():
    rng = random.Random(1)
    core, _ = make_core(num_blocks=128, max_num_seqs=8, budget=24, overlap=True)
    seqs = [make_seq(i, rng.randint(1, 60), max_tokens=rng.randint(1, 20)) for i in range(32)]
    for s in seqs:
        core.add(s)
    outs = run_overlapped(core)
    for s in seqs:
        expected = reference_output(s.prompt_token_ids, s.stop.max_tokens)
        assert streamed(outs, s.seq_id) == expected
        [final] = finals(outs, s.seq_id)
        assert final.finish_reason is FinishReason.LENGTH
        assert final.final.completion_tokens == len(expected)
    assert core.scheduler.blocks.num_free_blocks == 128


def test_a_stop_string_found_while_the_next_step_runs_drops_that_steps_token():
    core, runner = make_core(overlap=True)
    s = make_seq(1, 5, max_tokens=50, stop=("w7 w8",))
    runner.script = {1: [3, 4, 7, 8, 9, 10]}
    core.add(s)
    outs = run_overlapped(core)
    assert "".join(o.text for o in outs) == "w3 w4 "
    [final] = finals(outs, 1)
    assert final.finish_reason is FinishReason.STOP
    assert s.output_token_ids == [3, 4, 7, 8] and final.final.completion_tokens == 4
    # the step launched before the stop string was seen computed token 9: never streamed
    assert runner.script[1] == [10] and 9 not in streamed(outs, 1)
    assert core.scheduler.blocks.num_free_blocks == 256


def test_a_cancel_while_a_step_is_in_flight_ends_the_stream_once_and_bills_what_it_streamed():
    core, _ = make_core(overlap=True)
    s = make_seq(1, 6, max_tokens=100, ignore_eos=True)
    core.add(s)
    cancelled = []

    def cancel_after_three(outs):
        if not cancelled and len(streamed(outs, 1)) >= 3:
            cancelled.append(core.abort(1))

    outs = run_overlapped(core, cancel_after_three)
    outs += cancelled
    [final] = finals(outs, 1)
    assert final.finish_reason is FinishReason.CANCELLED
    assert final.final.completion_tokens == len(streamed(outs, 1)) == 3
    assert streamed(outs, 1) == reference_output(s.prompt_token_ids, 3)
    assert core.scheduler.blocks.num_free_blocks == 256


def test_a_cancel_before_a_completed_steps_outputs_are_taken_sends_them_with_the_end():
    """complete(n) has appended a token that take_outputs has not emitted yet: the cancel's
    final output carries it, and it is billed once (no second final from take_outputs)."""
    core, _ = make_core(overlap=True)
    s = make_seq(1, 6, max_tokens=100, ignore_eos=True)
    core.add(s)
    core.complete(core.launch())  # the prompt and the first token
    out = core.abort(1)
    assert out.token_ids == reference_output(s.prompt_token_ids, 1)
    assert out.finish_reason is FinishReason.CANCELLED and out.final.completion_tokens == 1
    assert core.take_outputs() == [] and not core.has_outputs()


def test_cancelling_100_overlapped_streams_at_random_points_returns_every_block():
    rng = random.Random(7)
    core, _ = make_core(num_blocks=96, block_size=4, max_num_seqs=12, budget=48, overlap=True)
    initial = core.scheduler.blocks.num_free_blocks
    shared = list(range(1, 30))  # some share a prefix (cached, ref-counted blocks)
    live = set(range(100))
    for i in range(100):
        prompt = shared + [i] * rng.randint(0, 20) if i % 3 == 0 else None
        core.add(make_seq(i, rng.randint(1, 40), prompt=prompt, max_tokens=1000, ignore_eos=True))
    ended = []

    def cancel_some(outs):
        for sid in sorted(live):
            if rng.random() < 0.1:
                ended.append(core.abort(sid))
                live.discard(sid)

    outs = run_overlapped(core, cancel_some) + ended
    assert not live
    for i in range(100):
        [final] = finals(outs, i)
        assert final.finish_reason is FinishReason.CANCELLED
        assert final.final.completion_tokens == len(streamed(outs, i))
    assert core.scheduler.blocks.num_free_blocks == initial


def test_energy_and_deadlines_in_the_overlapped_order():
    clock = Clock()
    core, _ = make_core(overlap=True, energy=Joules(), clock=clock)
    a = make_seq(1, 8, max_tokens=3)
    b = make_seq(2, 5, max_tokens=1000, ignore_eos=True, deadline=clock.t + 0.2)
    core.add(a)
    core.add(b)
    outs = run_overlapped(core)
    [fa], [fb] = finals(outs, 1), finals(outs, 2)
    assert fa.finish_reason is FinishReason.LENGTH and fa.final.energy_joules > 0
    assert fb.finish_reason is FinishReason.CANCELLED
    assert fb.final.completion_tokens == len(streamed(outs, 2))
    assert core.scheduler.blocks.num_free_blocks == 256


def test_a_step_failing_at_its_result_ends_its_requests_with_error_once():
    core, runner = make_core(overlap=True)
    core.add(make_seq(1, 5, max_tokens=5))
    core.add(make_seq(2, 5, max_tokens=5))
    core.complete(core.launch())

    class Failing:
        def result(self):
            raise RuntimeError("device lost")

    launched = core.launch()
    launched.pending = Failing()
    outs = core.take_outputs()
    core.complete(launched)
    outs += core.take_outputs()
    for sid in (1, 2):
        [final] = finals(outs, sid)
        assert final.finish_reason is FinishReason.ERROR
    assert not core.has_work() and core.scheduler.blocks.num_free_blocks == 256
    core.add(make_seq(3, 5, max_tokens=2))
    assert drain(core)[-1].finish_reason is FinishReason.LENGTH


def test_the_step_thread_launches_the_next_step_before_delivering_the_last_ones_tokens():
    """The point of overlapping: step n+1 is submitted before step n's tokens go out (on
    CUDA the device computes it meanwhile); every token still arrives, in order."""
    order = []
    lock = threading.Lock()
    core, runner = make_core(overlap=True)
    submit = runner.submit

    def recording_submit(batch, between_layers=None):
        with lock:
            order.append(("launch", len(batch.chunks)))
        return submit(batch, between_layers)

    runner.submit = recording_submit
    delivered = []
    done = threading.Event()

    def deliver(outputs):
        with lock:
            order.append(("deliver", sum(len(o.token_ids) for o in outputs)))
        delivered.extend(outputs)
        if any(o.finished for o in outputs):
            done.set()

    loop = EngineLoop(lambda: core, deliver)
    loop.start()
    try:
        assert loop.ready.wait(5)
        s = make_seq(1, 4, max_tokens=4)
        loop.submit(s)
        assert done.wait(5)
    finally:
        loop.stop()
    assert streamed(delivered, 1) == reference_output(s.prompt_token_ids, 4)
    launches = [i for i, (kind, _) in enumerate(order) if kind == "launch"]
    token_deliveries = [i for i, (kind, n) in enumerate(order) if kind == "deliver" and n]
    # the first token (step 1) goes out after step 2 was launched, and so on
    assert len(launches) == 4 and len(token_deliveries) == 4
    for step in range(3):
        assert launches[step + 1] < token_deliveries[step]
