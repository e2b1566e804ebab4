"""Speculative verification on a tiny random model: drafts change how many steps a request
takes, never what it generates (greedy and seeded sampling alike), and rejection sampling
keeps the model's distribution."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from services.engine.attention import build_metadata
from services.engine.block_manager import BlockManager
from services.engine.engine_core import EngineCore
from services.engine.interface import Batch, SamplingParams, SeqChunk
from services.engine.runner import ModelRunner
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import Sequence, StopCriteria
from services.engine.speculation import SpeculationConfig
from tests.unit.engine import tiny_models as tm

BS = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    # Weak residual updates: the random model falls into loops, which prompt lookup drafts
    # (many drafts accepted, many rejected).
    w = tm.random_weights(3)
    for name in w:
        if "o_proj" in name or "down_proj" in name:
            w[name] = w[name] * 0.3
    path = tm.write_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", w)
    return ModelRunner(path, block_size=BS, num_blocks=256, num_threads=1, seed=0)


def generate(runner, prompts, sampling, spec: bool, first_id: int) -> tuple[list[list[int]], int]:
    """Outputs of every prompt run together through the engine core; and draft tokens accepted."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                                      speculation=SpeculationConfig(enabled=spec, num_draft_tokens=5)),
                      BlockManager(runner.num_blocks, BS), set(runner.eos_token_ids))
    core = EngineCore(runner, sched)
    seqs = [Sequence(first_id + i, f"r{i}", list(p), sampling,
                     StopCriteria(max_tokens=48, ignore_eos=True)) for i, p in enumerate(prompts)]
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    runner.execute(Batch([], finished_seq_ids=[s.seq_id for s in seqs]))
    return [s.output_token_ids for s in seqs], sum(s.drafter.accepted for s in seqs if s.drafter)


PROMPTS = [[(i * 7) % 50 + 3 for i in range(24)] * 2, [5, 9, 11, 40, 41, 42, 43] * 5,
           list(range(10, 70))]


@pytest.mark.parametrize("sampling", [
    SamplingParams(),
    SamplingParams(temperature=0.5, seed=11),
    SamplingParams(top_k=20, temperature=0.5, repetition_penalty=1.05, seed=12),
], ids=["greedy", "seeded", "seeded_penalised"])
def test_drafts_never_change_the_output(runner, sampling):
    plain, _ = generate(runner, PROMPTS, sampling, spec=False, first_id=100)
    fast, accepted = generate(runner, PROMPTS, sampling, spec=True, first_id=200)
    assert fast == plain
    assert accepted > 0  # the comparison covered accepted drafts


def test_rejection_sampling_keeps_the_distribution(runner):
    """4000 seeds verify the same draft after the same context in one batch (every row writes
    identical K/V into the same slots). The first token must follow the model's softmax
    (chi-square), the draft must be kept with its probability, and every seed must give what
    plain sampling gives."""
    prompt = [(i * 13) % tm.VOCAB for i in range(9)]
    temp = 1.5
    table = [0, 1, 2]
    runner.execute(Batch([SeqChunk(1, prompt[:-1], 0, table, False, SamplingParams())]))
    meta = build_metadata([(0, len(prompt), table)], BS, "cpu")
    with torch.inference_mode():
        logits = runner.model.forward(torch.tensor(prompt), torch.arange(len(prompt)), meta,
                                      runner.kv, torch.tensor([len(prompt) - 1]))[0]
    p = torch.softmax(logits / temp, -1)
    draft = int(p.argsort(descending=True)[1])  # a plausible, not certain, guess
    n = 4000
    sp = [SamplingParams(temperature=temp, seed=s) for s in range(n)]
    spec = runner.execute(Batch([SeqChunk(1000 + s, [prompt[-1], draft, 3], len(prompt) - 1, table,
                                          True, sp[s], prompt, num_draft_tokens=2)
                                 for s in range(n)]))
    runner.execute(Batch([], finished_seq_ids=[1000 + s for s in range(n)]))
    plain = runner.execute(Batch([SeqChunk(9000 + s, [prompt[-1]], len(prompt) - 1, table,
                                           True, sp[s], prompt) for s in range(n)]))
    runner.execute(Batch([], finished_seq_ids=[9000 + s for s in range(n)]))
    firsts = [(spec.accepted[1000 + s] or [spec.sampled[1000 + s]])[0].token_id for s in range(n)]
    assert firsts == [plain.sampled[9000 + s].token_id for s in range(n)]
    kept = sum(1 for s in range(n) if spec.accepted[1000 + s])
    pd = float(p[draft])
    assert abs(kept - n * pd) < 5 * math.sqrt(n * pd * (1 - pd))
    # chi-square over tokens expected >= 10 times, the rest pooled
    counts = Counter(firsts)
    expected = (p * n).tolist()
    big = [t for t in range(tm.VOCAB) if expected[t] >= 10]
    chi2 = sum((counts[t] - expected[t]) ** 2 / expected[t] for t in big)
    rest_obs = n - sum(counts[t] for t in big)
    rest_exp = n - sum(expected[t] for t in big)
    chi2 += (rest_obs - rest_exp) ** 2 / max(rest_exp, 1e-9)
    dof = len(big)
    assert chi2 < dof + 6 * math.sqrt(2 * dof)  # far beyond the 99.99th percentile
