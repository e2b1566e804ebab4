"""Paged KV cache: any split of the same tokens into chunks, blocks and batches gives the
same next-token distribution as one plain prefill."""
from __future__ import annotations

import pytest

from services.engine.interface import Batch, SamplingParams, SeqChunk
from services.engine.runner import ModelRunner
from tests.unit.engine import tiny_models as tm

BS = 4  # small blocks so short prompts span many of them
LP = SamplingParams(logprobs=True, top_logprobs=5)


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    path = tm.write_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", tm.random_weights(1))
    return ModelRunner(path, block_size=BS, num_blocks=64, num_threads=1)


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % tm.VOCAB for i in range(n)]


def chunk(seq_id, ids, start, table, sample=True):
    return SeqChunk(seq_id=seq_id, token_ids=ids, start_pos=start, block_table=table,
                    sample=sample, sampling=LP)


def reference(runner: ModelRunner, ids: list[int]):
    """One prefill over consecutive blocks 40.. (kept apart from the blocks tests use)."""
    table = list(range(40, 40 + -(-len(ids) // BS)))
    return runner.execute(Batch([chunk(999, ids, 0, table)])).sampled[999]


def assert_same(a, b, tol=1e-4):
    assert a.token_id == b.token_id
    assert a.logprob == pytest.approx(b.logprob, abs=tol)
    assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    for x, y in zip(a.top, b.top):
        assert x.logprob == pytest.approx(y.logprob, abs=tol)


def test_chunked_prefill_on_scattered_blocks_matches_one_prefill(runner):
    ids = prompt(23, 1)
    table = [9, 2, 17, 5, 11, 30]  # 6 blocks of 4 cover 23 positions
    r = runner.execute(Batch([chunk(1, ids[:7], 0, table, sample=False)]))
    assert r.sampled == {}
    runner.execute(Batch([chunk(1, ids[7:16], 7, table, sample=False)]))
    out = runner.execute(Batch([chunk(1, ids[16:], 16, table)])).sampled[1]
    assert_same(out, reference(runner, ids))


def test_decode_steps_match_prefill(runner):
    ids = prompt(10, 2)
    table = [3, 8, 1]
    runner.execute(Batch([chunk(2, ids[:8], 0, table, sample=False)]))
    runner.execute(Batch([chunk(2, ids[8:9], 8, table, sample=False)]))
    out = runner.execute(Batch([chunk(2, ids[9:], 9, table)])).sampled[2]
    assert_same(out, reference(runner, ids))


def test_mixed_batch_matches_each_sequence_alone(runner):
    a, b, c, d = prompt(13, 3), prompt(21, 4), prompt(6, 5), prompt(17, 6)
    ta, tb, tc, td = [0, 4, 6, 10], [12, 13, 14, 15, 16, 18], [20, 22], [24, 19, 26, 27, 28]
    # Set up: b has its first 12 tokens cached, c and d everything but their last token.
    runner.execute(Batch([chunk(11, b[:12], 0, tb, False), chunk(12, c[:5], 0, tc, False),
                          chunk(13, d[:16], 0, td, False)]))
    # One step: a fresh prefill, a prefill continuation (start_pos > 0) and two decodes.
    step = [chunk(13, d[16:], 16, td), chunk(10, a, 0, ta), chunk(12, c[5:], 5, tc),
            chunk(11, b[12:], 12, tb)]
    out = runner.execute(Batch(step)).sampled
    assert set(out) == {10, 11, 12, 13}
    for seq, ids in ((10, a), (11, b), (12, c), (13, d)):
        assert_same(out[seq], reference(runner, ids))


def test_batched_decodes_of_different_lengths(runner):
    seqs = {20 + i: prompt(5 + 6 * i, 10 + i) for i in range(4)}
    tables = {20: [1, 3], 21: [5, 7, 2], 22: [9, 10, 11, 12, 13], 23: [14, 15, 16, 17, 18, 19, 21]}
    runner.execute(Batch([chunk(s, ids[:-1], 0, tables[s], False) for s, ids in seqs.items()]))
    out = runner.execute(Batch([chunk(s, ids[-1:], len(ids) - 1, tables[s])
                                for s, ids in seqs.items()])).sampled
    for s, ids in seqs.items():
        assert_same(out[s], reference(runner, ids))


def test_greedy_generation_is_deterministic_across_batch_mixes(runner):
    ids = prompt(9, 7)

    def generate(seq_id, table, noise: bool):
        out = runner.execute(Batch([chunk(seq_id, ids, 0, table)])).sampled[seq_id].token_id
        toks = [out]
        for step in range(6):
            pos = len(ids) + step
            batch = [chunk(seq_id, [toks[-1]], pos, table)]
            if noise:  # an unrelated sequence prefilling in the same steps
                batch.append(chunk(77, prompt(3, step), 0, [39]))
            toks.append(runner.execute(Batch(batch)).sampled[seq_id].token_id)
        return toks

    assert generate(30, [0, 1, 2, 3], False) == generate(31, [33, 5, 36, 7], True)


@pytest.mark.parametrize("bad, match", [
    (dict(token_ids=[]), "no tokens"),
    (dict(block_table=[0]), "block_table"),
    (dict(block_table=[0, 64]), "out of range"),
    (dict(token_ids=[tm.VOCAB] + [1] * 5), "token id"),
    (dict(start_pos=510), "max_context"),
])
def test_malformed_chunks_are_rejected(runner, bad, match):
    kw = dict(seq_id=50, token_ids=[1] * 6, start_pos=0, block_table=[0, 1], sample=True,
              sampling=SamplingParams())
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        runner.execute(Batch([SeqChunk(**kw)]))


def test_runner_reports_what_the_core_needs(runner):
    assert runner.block_size == BS and runner.num_blocks == 64
    assert runner.max_context == min(tm.MAX_POS, 64 * BS)
    assert runner.vocab_size == tm.VOCAB
    assert runner.eos_token_ids == (2,)
    assert runner.model_name == "tiny-llama"
    assert runner.load_seconds > 0
    assert runner.execute(Batch([])).sampled == {}


def test_kv_cache_sized_from_bytes(tmp_path):
    path = tm.write_gguf(tmp_path / "t.gguf", tm.random_weights(2))
    per_block = 2 * tm.LAYERS * 16 * tm.KV_HEADS * tm.HEAD_DIM * 4
    r = ModelRunner(path, kv_cache_bytes=10 * per_block + 5, num_threads=1)
    assert r.num_blocks == 10 and r.max_context == 160
    auto = ModelRunner(path, max_num_seqs=2, num_threads=1)
    assert auto.num_blocks == 2 * tm.MAX_POS // 16  # capped at every sequence at full context


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_c_kernels_match_torch_ops(tmp_path, quant):
    path = tm.write_gguf(tmp_path / "k.gguf", tm.random_weights(3))
    fast = ModelRunner(path, block_size=BS, num_blocks=64, num_threads=1, quantization=quant)
    eager = ModelRunner(path, block_size=BS, num_blocks=64, num_threads=1, quantization=quant, kernels=False)
    ids = prompt(30, 9)
    batch = lambda: Batch([chunk(1, ids[:20], 0, list(range(8)), False), chunk(2, ids[:9], 0, [20, 21, 22])])
    fast.execute(batch())
    eager.execute(batch())
    for r in (fast, eager):  # a decode step after the prefill
        r.execute(Batch([chunk(2, ids[9:10], 9, [20, 21, 22])]))
    a = fast.execute(Batch([chunk(1, ids[20:], 20, list(range(8)))])).sampled[1]
    b = eager.execute(Batch([chunk(1, ids[20:], 20, list(range(8)))])).sampled[1]
    # the kernels' prompt rows read K/V back from the cache (float16 with int8), as decode rows
    # do; torch's attend to the fresh float32 ones
    assert_same(a, b, tol=1e-3 if fast.kv_cache_dtype == "float16" else 1e-4)


def test_a_prompts_held_last_token_is_a_prompt_row_and_matches_one_prefill(runner):
    """A burst holds each prompt's last token for one final step with the others' chunks: that
    token is computed as a prompt row (the step stays a prompt step), with the same result."""
    from services.engine.runner import _is_decode

    a, b = prompt(13, 3), prompt(9, 4)
    ta, tb = [12, 6, 21, 14], [25, 19, 7]
    runner.execute(Batch([chunk(3, a[:12], 0, ta, sample=False)]))
    held = SeqChunk(seq_id=3, token_ids=a[12:], start_pos=12, block_table=ta, sample=True, sampling=LP,
                    prompt_token_ids=a)
    assert not _is_decode(held)
    assert _is_decode(SeqChunk(seq_id=3, token_ids=[5], start_pos=13, block_table=ta, sample=True,
                               sampling=LP, prompt_token_ids=a))  # a generated token's step
    out = runner.execute(Batch([held, chunk(4, b, 0, tb)])).sampled
    assert_same(out[3], reference(runner, a))
    assert_same(out[4], reference(runner, b))
