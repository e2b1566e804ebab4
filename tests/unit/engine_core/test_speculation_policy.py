"""Which drafts are worth verifying: the continuation of the last copy (a JSON template filled
value by value), draft lengths that follow the match, the learned cost of a draft token, and
the per-step gate that keeps verification from making a compute-bound batch slower."""
from __future__ import annotations

import pytest

from services.engine.scheduler import DRAFT_TARGET_SHARE
from services.engine.step_costs import StepCosts
from services.engine.speculation import (NgramDrafter, SpeculationConfig, TenantAcceptance,
                                         draft_tokens_worth)
from tests.unit.engine_core.fakes import copying_token, make_seq, reference_output
from tests.unit.engine_core.test_engine_core import drain
from tests.unit.engine_core.test_speculation import code_prompt, make

# a "template" of keys K1..K4, each followed by an empty value E and a separator S
K1, K2, K3, K4, E, S, Q = 101, 102, 103, 104, 90, 91, 92


def test_after_a_value_it_copies_the_next_key_of_the_template():
    template = [7, 8, 9, Q, K1, E, S, Q, K2, E, S, Q, K3, E, S, Q, K4, E, 9]
    d = NgramDrafter(SpeculationConfig(num_draft_tokens=8))
    assert d.propose(template + [Q], 8) == [K1, E]
    d.observe(2, 1, len(template) + 3)  # K1 kept, E not: the answer writes its own value
    toks = template + [Q, K1, 55, E, S]
    # "E S" follows every key: the copy goes on after K1, where the last one came from
    assert d.propose(toks, 8) == [Q, K2, E, S]
    # with no copy to go on from, the latest occurrence is copied
    assert NgramDrafter(SpeculationConfig(num_draft_tokens=8)).propose(toks, 8) == [Q, K4]


def test_the_continuation_needs_only_the_last_token():
    template = [7, 8, 9, Q, K1, E, S, Q, K2, E, S, Q, K3, E, 9]
    d = NgramDrafter(SpeculationConfig(num_draft_tokens=8))
    assert d.propose(template + [Q], 8) == [K1, E]
    d.observe(2, 1, len(template) + 3)
    # a value, then a separator no bigram of the template has
    assert d.propose(template + [Q, K1, 55, 56, S], 8) == [Q, K2, E]


def test_a_long_match_wins_over_the_continuation():
    base = [1, 2, 3, 4, 50, 60, 2, 3]
    toks = base + [4, 50, 70] + [81, 82, 60, 2, 99] + [81, 82, 60, 2]
    for strong, expected in [(6, [3, 4, 50, 70]), (3, [99, 81, 82, 60])]:
        d = NgramDrafter(SpeculationConfig(num_draft_tokens=4, strong_match=strong))
        assert d.propose(base, 4) == [4, 50]
        d.observe(2, 2, len(base) + 3)  # the copy's source is base's 50
        # "60 2" follows the source (agreeing on 2 tokens) and recurs later (agreeing on 4)
        assert d.propose(toks, 4) == expected


def test_draft_length_follows_the_evidence():
    weak = NgramDrafter(SpeculationConfig(num_draft_tokens=8))
    assert weak.propose([1, 2, 3, 4, 5, 6, 7, 9, 2, 3], 8) == [4, 5]  # a 2-token match risks 2
    long = NgramDrafter(SpeculationConfig(num_draft_tokens=8))
    assert long.propose(list(range(20)) + list(range(12)), 8) == list(range(12, 20))


def test_draft_tokens_worth_their_cost():
    assert draft_tokens_worth(0.9, 0.0, 8) == 8  # cost unknown (or free): everything
    assert draft_tokens_worth(0.9, 0.1, 50) == 21  # 0.9**21 >= 0.1 > 0.9**22
    assert draft_tokens_worth(0.5, 0.1, 8) == 3
    assert draft_tokens_worth(0.5, 0.6, 8) == 0  # not even the first pays
    assert draft_tokens_worth(1.0, 1.0, 5) == 5


def test_step_costs_learn_what_a_draft_token_adds():
    c = StepCosts()
    assert c.draft_min_yield(1) == 0.0  # unknown: draft freely
    for drafts in [0, 8, 2, 5, 0, 8, 3, 1] * 4:
        c.observe(decode_rows=4, prompt_tokens=0, seconds=0.020 + 0.002 * drafts,
                  draft_tokens=drafts)
    assert c.per_draft_token == pytest.approx(0.002, rel=1e-6)
    assert c.decode_step == pytest.approx(0.020, rel=1e-6)
    # a draft token must be expected to yield 0.002 s / (0.020 s / 4 tokens) = 0.4 tokens
    assert c.draft_min_yield(4) == pytest.approx(0.4)
    # a mixed step: the prompt's share is what is left after the decodes and their drafts
    c.observe(decode_rows=4, prompt_tokens=100, seconds=0.020 + 0.002 * 5 + 0.1, draft_tokens=5)
    assert c.per_prompt_token == pytest.approx(0.001)


def test_step_costs_tell_rows_from_drafts_while_the_batch_changes():
    """Requests finish as drafting goes on: fewer rows and fewer drafts together must not be
    read as expensive drafts."""
    c = StepCosts()
    for rows in (16, 12, 8, 4, 2, 1):
        for drafts in (0, rows * 2, rows, rows * 3):
            c.observe(rows, 0, 0.010 + 0.003 * rows + 0.001 * drafts, drafts)
    assert c.per_draft_token == pytest.approx(0.001, rel=1e-6)
    assert c.plain_decode(16) == pytest.approx(0.058, rel=1e-6)
    assert c.draft_min_yield(1) == pytest.approx(0.001 / 0.013)  # one stream: most drafts pay
    assert c.draft_min_yield(16) == pytest.approx(0.016 / 0.058)


def test_a_draft_cost_that_stopped_all_drafting_is_forgotten_after_steps_without_drafts():
    """One slow step while drafting can make drafts look dearer than a whole decode step;
    then no draft is verified, so nothing would correct the estimate again."""
    c = StepCosts()
    for drafts in [0, 8, 2, 5] * 4:  # drafts that look to cost 10 ms a token
        c.observe(decode_rows=4, prompt_tokens=0, seconds=0.020 + 0.010 * drafts,
                  draft_tokens=drafts)
    assert c.draft_min_yield(4) > 1.0  # no draft can pay: drafting stops
    for _ in range(StepCosts._DRAFT_COST_TTL - 1):
        c.observe(decode_rows=4, prompt_tokens=0, seconds=0.020)
    assert c.draft_min_yield(4) > 1.0  # still within the estimate's lifetime
    c.observe(decode_rows=4, prompt_tokens=0, seconds=0.020)
    assert c.draft_min_yield(4) == 0.0  # forgotten: drafts are tried and measured again
    for drafts in [0, 8, 2, 5, 0, 8, 3, 1] * 4:
        c.observe(decode_rows=4, prompt_tokens=0, seconds=0.020 + 0.002 * drafts,
                  draft_tokens=drafts)
    assert c.draft_min_yield(4) == pytest.approx(0.4, rel=0.05)


def _drafted(runner):
    return sum(c.num_draft_tokens for b in runner.batches for c in b.chunks)


def test_a_compute_bound_batch_verifies_only_drafts_that_pay():
    """Each draft token costs as much as a decode row: only near-certain drafts pay, and the
    fast and the plain runs give the same tokens."""
    prompts = [code_prompt(30 + i) for i in range(4)]

    def run(cost_per_draft):
        core, runner = make(max_num_seqs=4)
        # decode rows and prompt tokens (drafts count with the latter) -> seconds
        runner.cost = lambda rows, other: 0.004 * rows + cost_per_draft * other + 0.001
        seqs = [make_seq(i, prompt=p, max_tokens=60, ignore_eos=True) for i, p in enumerate(prompts)]
        for s in seqs:
            core.add(s)
        drain(core)
        for s in seqs:
            assert s.output_token_ids == reference_output(s.prompt_token_ids, 60, copying_token)
        return _drafted(runner), sum(s.drafter.accepted for s in seqs)

    cheap_drafted, cheap_accepted = run(0.0002)
    dear_drafted, dear_accepted = run(0.004)
    assert dear_drafted < cheap_drafted / 2
    # what is still drafted is the likeliest part
    assert dear_accepted / dear_drafted > cheap_accepted / cheap_drafted


def test_drafts_never_take_a_waiting_prompts_budget():
    core, runner = make(max_num_batched_tokens=40, max_num_seqs=4)
    a = make_seq(1, prompt=code_prompt(5, 60), max_tokens=200, ignore_eos=True)
    core.add(a)
    for _ in range(25):
        core.step()
    assert _drafted(runner)  # a is decoding with drafts
    b = make_seq(2, prompt=code_prompt(6, 300), max_tokens=5, ignore_eos=True)
    core.add(b)
    core.step()
    batch = runner.batches[-1]
    prompt = next(c for c in batch.chunks if c.seq_id == 2)
    assert len(prompt.token_ids) == 40 - 1  # every token the decode leaves, none to drafts
    assert all(c.num_draft_tokens == 0 for c in batch.chunks)


def test_a_drafts_kind_decides_how_far_it_is_verified():
    """A tenant's short matches miss and its long ones are kept (a chat answer): a new answer
    of that tenant verifies a long match in full and a short one not at all where a draft
    token must yield half a token, while a new tenant starts from the whole engine's record."""
    acceptance = TenantAcceptance(max_tenants=2)
    strong = list(range(20)) + list(range(12))  # agrees on 12 tokens: copies 12..19
    weak = [1, 2, 3, 4, 5, 6, 7, 9, 2, 3]  # agrees on 2: copies 4, 5
    fresh = NgramDrafter(SpeculationConfig(), None, "chat", acceptance.estimates("chat"))
    assert fresh.propose(weak, 8, min_yield=0.5) == [4, 5]  # nothing known: certain
    assert fresh.kind == "weak"
    est = acceptance.estimates("chat")
    for _ in range(60):
        for kind, accepted in (("weak", 0), ("strong", 8)):
            est[kind].observe(8 if kind == "strong" else 2, accepted)
            acceptance.record(kind, 8 if kind == "strong" else 2, accepted)
    answer = NgramDrafter(SpeculationConfig(), None, "chat", acceptance.estimates("chat"))
    assert answer.chance("weak") < 0.1 < 0.95 < answer.chance("strong")
    assert answer.propose(weak, 8, min_yield=0.5) == [] and answer.kind is None
    assert answer.propose(strong, 8, min_yield=0.5) == list(range(12, 20))
    assert answer.kind == "strong"
    assert answer.propose(weak, 8) == [4, 5]  # drafts that cost nothing are all verified
    # the sequence's verification moves its tenant's estimate of that kind
    answer.propose(strong, 8, min_yield=0.5)
    before = acceptance.estimates("chat")["strong"].rate
    answer.observe(8, 0, 40)
    assert acceptance.estimates("chat")["strong"].rate < before
    # a new tenant starts from the engine's record; only the last max_tenants are kept
    assert acceptance.estimates("new")["weak"].rate < 0.1
    acceptance.estimates("third")
    acceptance.record("weak", 2, 2)
    assert acceptance.estimates("chat")["strong"].rate == acceptance.estimates("new")["strong"].rate


def _priced(draft_cost: float, **cfg):
    """An engine of 4 slots whose fake steps cost 4 ms a decode row, draft_cost a draft or
    prompt token and 1 ms, with those costs already learned."""
    core, runner = make(max_num_seqs=4, **cfg)
    runner.cost = lambda rows, other: 0.004 * rows + draft_cost * other + 0.001
    for d in [0, 8, 2, 5] * 4:
        core.scheduler.costs.observe(4, 0, runner.cost(4, d), d)
    return core, runner


def _copy_four_prompts(core, seed: int, max_tokens: int) -> None:
    """Streams four code prompts to the end; each output is the plain decoding's."""
    seqs = [make_seq(i, prompt=code_prompt(seed + i), max_tokens=max_tokens, ignore_eos=True)
            for i in range(4)]
    for s in seqs:
        core.add(s)
    drain(core)
    for s in seqs:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, max_tokens, copying_token)


def test_the_scheduler_verifies_drafts_by_the_tenants_record_of_their_kind():
    """In a compute-bound batch (a draft token costs a row) a tenant whose drafts have missed
    drafts nothing, while a tenant whose drafts were kept still drafts; the verifications teach the tenant's and the
    engine's estimates."""
    def drafted(tenant_record: float) -> int:
        core, runner = _priced(draft_cost=0.004)  # a draft token must yield ~0.94 tokens
        sched = core.scheduler
        est = sched.acceptance.estimates("t")
        for kind in est:
            for _ in range(60):
                est[kind].observe(4, round(4 * tenant_record))
        _copy_four_prompts(core, seed=40, max_tokens=40)
        return _drafted(runner), sched
    missed, _ = drafted(0.0)
    kept, sched = drafted(1.0)
    assert kept > 20
    assert missed == 0
    # the engine learned from the tenant's verifications: a new tenant does not start certain
    assert any(a.rate < 1.0 for a in sched.acceptance.estimates("other").values())


def test_drafts_keep_a_step_within_the_latency_target():
    """Four streams copying their prompts verify more than 10 draft tokens in some steps; at
    0.5 ms a draft token beside a 17 ms decode step, drafts may fill a step to 22 ms when the
    inter-token target is 22 ms / DRAFT_TARGET_SHARE (room for 10): the rest of the target is
    headroom for a step slower than planned."""
    def max_drafts(target: float) -> int:
        core, runner = _priced(draft_cost=0.0005, itl_target_s=target)
        _copy_four_prompts(core, seed=50, max_tokens=60)
        return max(sum(c.num_draft_tokens for c in b.chunks) for b in runner.batches)
    assert max_drafts(0.0) > 10
    assert 5 < max_drafts(0.022 / DRAFT_TARGET_SHARE) <= 10
