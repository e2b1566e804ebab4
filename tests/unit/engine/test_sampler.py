"""Sampler: greedy, temperature, top-k/top-p/min-p, penalties, seeds and logprobs."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from services.engine.interface import SamplingParams, SeqChunk
from services.engine.sampler import Sampler

V = 8
# A fixed distribution: probs ~ [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]
PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
LOGITS = PROBS.log()


def ch(seq_id: int, prompt=(), output=(), **kw) -> SeqChunk:
    return SeqChunk(seq_id=seq_id, token_ids=[0], start_pos=0, block_table=[0], sample=True,
                    sampling=SamplingParams(**kw), prompt_token_ids=list(prompt),
                    output_token_ids=list(output))


def draw(params: dict, n: int = 2000, seed: int = 0) -> Counter:
    s = Sampler(seed=seed)
    chunks = [ch(i, **params) for i in range(n)]
    out = s.sample(LOGITS.repeat(n, 1), chunks)
    return Counter(t.token_id for t in out)


def test_greedy_is_argmax_per_row():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler(seed=0).sample(logits, [ch(i) for i in range(5)])
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()
    assert all(t.logprob is None and t.top == () for t in out)


def test_temperature_one_follows_the_distribution():
    counts = draw({"temperature": 1.0}, n=4000)
    for tok, p in enumerate(PROBS.tolist()):
        assert abs(counts[tok] / 4000 - p) < 0.03


def test_low_temperature_sharpens():
    counts = draw({"temperature": 0.2}, n=1000)
    assert counts[0] > 850


@pytest.mark.parametrize("params, allowed", [
    ({"temperature": 1.0, "top_k": 1}, {0}),
    ({"temperature": 1.0, "top_k": 3}, {0, 1, 2}),
    ({"temperature": 1.0, "top_p": 0.5}, {0, 1}),       # 0.4 < 0.5, so the 2nd token stays
    ({"temperature": 1.0, "top_p": 0.3}, {0}),
    ({"temperature": 1.0, "min_p": 0.3}, {0, 1, 2}),    # >= 0.3 * 0.4 = 0.12
    ({"temperature": 1.0, "top_k": 4, "top_p": 0.99, "min_p": 0.3}, {0, 1, 2}),
])
def test_filters_restrict_the_support(params, allowed):
    counts = draw(params, n=1500)
    assert set(counts) == allowed


def test_top_p_renormalises_kept_tokens():
    counts = draw({"temperature": 1.0, "top_p": 0.5}, n=4000)
    assert abs(counts[0] / 4000 - 0.4 / 0.65) < 0.03


def test_same_seed_same_tokens_whatever_the_batch():
    def run(batch_extra: int, position: int) -> list[int]:
        s = Sampler()
        toks = []
        for step in range(20):
            chunks = [ch(100 + j, temperature=1.0) for j in range(batch_extra)]
            chunks.insert(position, ch(7, temperature=0.9, top_p=0.95, seed=1234))
            logits = torch.randn(len(chunks), V, generator=torch.Generator().manual_seed(step))
            logits[position] = LOGITS  # the seeded row always sees the same logits
            out = s.sample(logits, chunks)
            toks.append(out[position].token_id)
        return toks

    alone = run(0, 0)
    assert alone == run(5, 3) == run(2, 2)
    assert len(set(alone)) > 1  # it really sampled


def test_different_seeds_differ_and_forget_restarts():
    s = Sampler()
    a = [s.sample(LOGITS[None], [ch(1, temperature=1.0, seed=1)])[0].token_id for _ in range(30)]
    b = [s.sample(LOGITS[None], [ch(2, temperature=1.0, seed=2)])[0].token_id for _ in range(30)]
    assert a != b
    s.forget([1])
    again = [s.sample(LOGITS[None], [ch(1, temperature=1.0, seed=1)])[0].token_id for _ in range(30)]
    assert again == a


def test_repetition_penalty_over_prompt_and_output():
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1]])
    s = Sampler(seed=0)
    assert s.sample(logits, [ch(1, prompt=[0], repetition_penalty=1.2)])[0].token_id == 1
    assert s.sample(logits, [ch(1, output=[0], repetition_penalty=1.2)])[0].token_id == 1
    # negative logits are pushed further down: token 2 (-1.0 -> -1.2) loses to token 3 (-1.1)
    neg = torch.tensor([[-1.0, -1.1, -5.0, -5.0]])
    assert s.sample(neg, [ch(1, prompt=[0], repetition_penalty=1.2)])[0].token_id == 1


def test_presence_and_frequency_penalties_use_output_only():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    s = Sampler(seed=0)
    assert s.sample(logits, [ch(1, prompt=[0, 0, 0], presence_penalty=1.0)])[0].token_id == 0
    assert s.sample(logits, [ch(1, output=[0], presence_penalty=1.0)])[0].token_id == 1
    assert s.sample(logits, [ch(1, output=[0], frequency_penalty=0.4)])[0].token_id == 0  # 2.6 > 2.5
    assert s.sample(logits, [ch(1, output=[0, 0], frequency_penalty=0.4)])[0].token_id == 1


def test_logprobs_with_top_alternatives():
    s = Sampler(seed=0)
    out = s.sample(LOGITS.repeat(2, 1), [ch(1, logprobs=True, top_logprobs=3), ch(2, logprobs=True)])
    a, b = out
    assert a.token_id == 0 and a.logprob == pytest.approx(math.log(0.4), abs=1e-5)
    assert [t.token_id for t in a.top] == [0, 1, 2]
    assert [t.logprob for t in a.top] == pytest.approx([math.log(p) for p in (0.4, 0.25, 0.15)], abs=1e-5)
    assert b.logprob == pytest.approx(math.log(0.4), abs=1e-5) and b.top == ()


def test_logprob_of_a_sampled_token_is_its_own():
    out = Sampler(seed=3).sample(LOGITS.repeat(50, 1), [ch(i, temperature=1.0, logprobs=True) for i in range(50)])
    for t in out:
        assert t.logprob == pytest.approx(math.log(PROBS[t.token_id].item()), abs=1e-5)


def test_mixed_greedy_and_sampled_rows():
    chunks = [ch(0), ch(1, temperature=1.0, top_k=2), ch(2)]
    logits = torch.stack([LOGITS, LOGITS, LOGITS.flip(0)])
    out = Sampler(seed=0).sample(logits, chunks)
    assert out[0].token_id == 0 and out[1].token_id in (0, 1) and out[2].token_id == V - 1
