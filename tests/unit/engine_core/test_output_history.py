"""Drafting from earlier outputs: the history's bounds and tenant isolation, its drafts, and
through the engine core on the fake runner: greedy output identical with history drafts, and
answers that repeat a template across requests accept them."""
from __future__ import annotations

from services.engine.output_history import OutputHistory, Source
from services.engine.speculation import NgramDrafter, SpeculationConfig
from tests.unit.engine_core.fakes import make_seq, next_token, reference_output
from tests.unit.engine_core.test_speculation import make, streamed
from tests.unit.engine_core.test_engine_core import drain


# -- the history --------------------------------------------------------------------------
def test_drafts_what_followed_the_tail_in_an_earlier_output():
    h = OutputHistory()
    h.record("t", [1, 2, 3, 4, 5, 6, 7, 8])
    draft, agreement, source = h.propose("t", [50, 60, 2, 3, 4], 3)
    assert (draft, agreement) == ([5, 6, 7], 3)
    assert source.position == 3
    assert h.propose("t", [9, 1, 2, 3, 4], 10)[:2] == ([5, 6, 7, 8], 4)  # agrees on 4


def test_no_draft_when_nothing_matches():
    h = OutputHistory()
    assert h.propose("t", [1, 2, 3], 4) == ([], 0, None)  # empty history
    h.record("t", [1, 2, 3, 4, 5, 6])
    assert h.propose("t", [7, 8, 9], 4) == ([], 0, None)
    assert h.propose("t", [9, 2, 3], 4) == ([], 0, None)  # two tokens are below KEY_TOKENS
    assert h.propose("t", [4, 5, 6], 4) == ([], 0, None)  # nothing followed it
    h.record("t", [1, 2])  # too short to match anything: not kept
    assert h.num_outputs("t") == 1


def test_prefers_the_occurrence_that_agrees_longest_then_the_newest():
    h = OutputHistory()
    h.record("t", [9, 8, 1, 2, 3, 40])
    h.record("t", [7, 1, 2, 3, 50])
    assert h.propose("t", [9, 8, 1, 2, 3], 1)[0] == [40]  # agrees on 5 tokens, not 4
    assert h.propose("t", [0, 1, 2, 3], 1)[0] == [50]  # a tie: the newest output


def test_continues_the_last_source_after_a_token_it_did_not_hold():
    h = OutputHistory()
    h.record("t", [10, 11, 12, 13, 99, 14, 15, 16, 17])
    draft, _, source = h.propose("t", [10, 11, 12], 8)
    assert draft[:2] == [13, 99]
    # the model wrote 13 then its own value 77 and then 14: no 3-token match holds 77, 14,
    # but 14 follows the last copy's source within the window
    draft, agreement, source = h.propose("t", [10, 11, 12, 13, 77, 14], 3,
                                         after=Source(source.output, source.position + 1))
    assert (draft, agreement) == ([15, 16, 17], 1)
    assert h.propose("t", [10, 11, 12, 13, 77, 14], 3)[0] == []  # no source: no draft


def test_eviction_keeps_the_last_outputs_within_both_bounds():
    h = OutputHistory(max_completions=3, max_tokens=20)
    for i in range(5):
        h.record("t", [100 * i + j for j in range(6)])
    assert (h.num_outputs("t"), h.num_tokens("t")) == (3, 18)
    assert h.propose("t", [100, 101, 102], 2)[0] == []  # the oldest are gone
    assert h.propose("t", [400, 401, 402], 2)[0] == [403, 404]
    h.record("t", list(range(1000, 1015)))  # 15 tokens: only it and nothing older fits 20
    assert (h.num_outputs("t"), h.num_tokens("t")) == (1, 15)
    h.record("t", list(range(2000, 2050)))  # longer than the bound: its last 20 tokens
    assert h.num_tokens("t") == 20 and h.propose("t", [2030, 2031, 2032], 1)[0] == [2033]
    assert h.propose("t", [2000, 2001, 2002], 1)[0] == []


def test_a_tenant_never_drafts_from_another_tenants_outputs():
    h = OutputHistory(max_completions=2, max_tenants=2)
    h.record("a", [1, 2, 3, 4, 5])
    assert h.propose("b", [1, 2, 3], 2) == ([], 0, None)
    for i in range(10):  # b's traffic neither reaches a's drafts nor evicts a's outputs
        h.record("b", [1, 2, 3, 60 + i, 61])
    assert h.propose("a", [1, 2, 3], 2)[0] == [4, 5]
    assert h.num_outputs("a") == 1 and h.num_outputs("b") == 2
    # past max_tenants, the least recently served tenant's history is dropped
    h.record("c", [7, 8, 9, 10])
    assert h.tenants == ["a", "c"]  # a was served (proposed) after b's last record
    assert h.propose("b", [1, 2, 3], 2)[0] == []


def test_the_drafter_takes_a_history_match_when_the_own_tokens_have_no_better_one():
    h = OutputHistory()
    h.record("t", [5, 6, 7, 8, 9, 10, 11, 12])
    d = NgramDrafter(SpeculationConfig(num_draft_tokens=8), h, "t")
    assert d.propose([1, 2, 6, 7, 8], 8) == [9, 10, 11, 12]  # 3 agreed: 3 + 2 tokens at most
    d.observe(4, 4, 9)
    assert (d.history_proposed, d.history_accepted) == (4, 4)
    other = NgramDrafter(SpeculationConfig(num_draft_tokens=8), h, "u")
    assert other.propose([1, 2, 6, 7, 8], 8) == []  # another tenant: nothing


def test_the_drafter_stops_searching_a_history_whose_drafts_miss():
    h = OutputHistory()
    h.record("t", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    d = NgramDrafter(SpeculationConfig(num_draft_tokens=4, min_acceptance=0.1), h, "t")
    tokens = [50, 1, 2, 3]
    for _ in range(6):
        assert d.propose(tokens, 4)
        d.observe(4, 0, len(tokens) + 1)
    assert d.history_proposed == 24 and d.propose(tokens, 4) == []


# -- through the engine core --------------------------------------------------------------
START = 900  # ends every prompt of the template model
TEMPLATE = [(7 * i) % 800 + 1 for i in range(40)]


def template_token(context: list[int]) -> int:
    """A 'tool-call model': after START it writes TEMPLATE, except every fifth token, a value
    drawn from the prompt. Different prompts share every other token of their answers, and no
    prompt holds them."""
    start = len(context) - 1 - context[::-1].index(START)
    i = len(context) - 1 - start
    if i % 5 == 4:
        return next_token(context[:start] + [i]) % 800 + 1
    return TEMPLATE[i % len(TEMPLATE)]


def tool_prompt(seed: int) -> list[int]:
    return [(seed * 31 + j * 7) % 800 + 1 for j in range(12)] + [START]


def test_greedy_output_with_history_drafts_equals_output_without_speculation():
    plain, _ = make(spec=SpeculationConfig(enabled=False), model=template_token)
    core, runner = make(model=template_token)
    warm = make_seq(1, prompt=tool_prompt(1), max_tokens=40, ignore_eos=True, tenant="a")
    core.add(warm)
    drain(core)
    assert core.scheduler.history.num_outputs("a") == 1
    seqs = [make_seq(10 + i, prompt=tool_prompt(10 + i), max_tokens=40, ignore_eos=True,
                     tenant="a") for i in range(3)]
    lone = make_seq(20, prompt=tool_prompt(20), max_tokens=40, ignore_eos=True, tenant="b")
    for s in (*seqs, lone):
        core.add(s)
    outs = drain(core)
    for s in (*seqs, lone):
        ref = reference_output(s.prompt_token_ids, 40, template_token)
        assert streamed(outs, s.seq_id) == ref == s.output_token_ids
        p = make_seq(100 + s.seq_id, prompt=s.prompt_token_ids, max_tokens=40, ignore_eos=True)
        plain.add(p)
        drain(plain)
        assert p.output_token_ids == ref
    # a's requests drafted from a's earlier answer and skipped steps; b had no history
    assert all(s.drafter.history_accepted >= 10 for s in seqs)
    assert lone.drafter.history_proposed == 0
    assert core.scheduler.blocks.num_free_blocks == 128


def test_an_opted_out_request_is_not_drafted_from():
    core, _ = make(model=template_token)
    core.add(make_seq(1, prompt=tool_prompt(1), max_tokens=40, ignore_eos=True,
                      speculation=False))
    drain(core)
    assert core.scheduler.history.num_outputs("t") == 0
    off, _ = make(spec=SpeculationConfig(history_outputs=0), model=template_token)
    assert off.scheduler.history is None
