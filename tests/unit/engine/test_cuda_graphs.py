"""The CUDA-graph decode path's CPU-testable logic: bucket choice, packing and padding of a
step's rows (slots, block tables, a scratch KV block no request owns), un-padding, and the
graph body's results against the eager step. Capture itself is CUDA-only and never attempted
on the CPU."""
from __future__ import annotations

import pytest
import torch

from services.engine import cuda_graphs as cg
from services.engine.attention import build_metadata
from services.engine.interface import Batch, SamplingParams, SeqChunk
from services.engine.runner import ModelRunner
from tests.unit.engine import tiny_models as tm

G = SamplingParams()


def decode(seq_id, token, pos, table, sample=True, drafts=()):
    return SeqChunk(seq_id, [token, *drafts], pos, table, sample, G, num_draft_tokens=len(drafts))


def test_bucket_is_the_smallest_that_holds_the_batch():
    assert [cg.bucket_for(n) for n in (1, 2, 3, 4, 5, 9, 17, 33, 63, 64)] == \
        [1, 2, 4, 4, 8, 16, 32, 64, 64, 64]
    assert cg.bucket_for(65) is None
    assert cg.graph_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert cg.graph_buckets(12) == (1, 2, 4, 8, 16)  # 12 rows pad to 16
    assert cg.graph_buckets(1) == (1,)
    assert cg.graph_buckets(500) == cg.BUCKETS  # more rows than that run eagerly


def test_only_plain_decode_steps_replay_a_graph():
    t = [0, 1, 2]
    ok = [decode(1, 5, 20, t), decode(2, 6, 3, t)]
    assert cg.fits(ok, cg.BUCKETS, 48)
    assert not cg.fits([], cg.BUCKETS, 48)
    assert not cg.fits(ok + [SeqChunk(3, [1, 2, 3], 0, t, True, G)], cg.BUCKETS, 48)  # prefill
    assert not cg.fits([decode(1, 5, 0, t)], cg.BUCKETS, 48)  # a 1-token prompt
    assert not cg.fits([decode(1, 5, 20, t, drafts=(7, 8))], cg.BUCKETS, 48)  # drafts
    assert not cg.fits([decode(1, 5, 48, t + [3])], cg.BUCKETS, 48)  # past the tables
    assert not cg.fits([decode(i, 5, 9, t) for i in range(5)], (1, 2, 4), 48)  # > largest


def test_pack_pads_rows_into_the_scratch_block_and_keeps_stale_columns_valid():
    bs, scratch, width = 4, 50, 6
    stage = cg.new_staging(8, width, bs, scratch).numpy()
    chunks = [decode(1, 11, 9, [7, 3, 12]),  # position 9: block 3rd (12), offset 1
              decode(2, 22, 2, [40])]
    cg.pack(stage, chunks, 4, bs, scratch)
    tok, pos, slot, ctx = (stage[:4, i].tolist() for i in range(cg.HEADER))
    assert tok == [11, 22, 0, 0] and pos == [9, 2, 0, 0] and ctx == [10, 3, 1, 1]
    assert slot == [12 * bs + 1, 40 * bs + 2, scratch * bs, scratch * bs]
    assert stage[0, cg.HEADER:cg.HEADER + 3].tolist() == [7, 3, 12]
    assert stage[1, cg.HEADER] == 40 and (stage[2:4, cg.HEADER] == scratch).all()
    # a later, shorter step over the same rows: row 0's old columns stay, valid block ids
    cg.pack(stage, [decode(5, 9, 1, [30])], 2, bs, scratch)
    assert stage[0, cg.HEADER:cg.HEADER + 3].tolist() == [30, 3, 12]
    assert stage[0, cg.CONTEXT] == 2 and stage[1, cg.SLOT] == scratch * bs
    assert (stage[:, cg.HEADER:] >= 0).all()
    with pytest.raises(ValueError, match="past the graphs"):
        cg.pack(stage, [decode(1, 1, width * bs, list(range(width + 1)))], 1, bs, scratch)


def test_unpack_gives_the_models_inputs():
    stage = cg.new_staging(2, 3, 4, 9)
    cg.pack(stage.numpy(), [decode(1, 7, 5, [2, 4])], 2, 4, 9)
    ids, positions, meta = cg.unpack(stage)
    assert ids.tolist() == [7, 0] and positions.tolist() == [5, 0]
    assert meta.slots.tolist() == [4 * 4 + 1, 9 * 4] and meta.decode_ctx.tolist() == [6, 1]
    assert meta.decode_blocks[:, :2].tolist() == [[2, 4], [9, 9]] and meta.decode_start == 0
    assert not meta.prefills and meta.decode_blocks.is_contiguous()


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tm.write_gguf(tmp_path_factory.mktemp("m") / "m.gguf", tm.random_weights(3))
    # 24 blocks: the test's "scheduler" uses 0..22; 23 is the scratch block
    return ModelRunner(path, num_blocks=24, block_size=4, num_threads=1)


def test_padded_step_equals_the_eager_step_and_writes_only_scratch(runner):
    """The graph body (pack -> unpack -> forward) on a padded bucket: the real rows' logits
    and K/V equal the eager step's; padded rows write only into the scratch block."""
    bs, scratch = runner.block_size, 23
    prompts = {1: [5, 9, 3, 7, 1, 2], 2: [8, 8, 4], 3: [11, 12, 13, 14, 15, 16, 17, 18, 19]}
    tables = {1: [4, 9], 2: [0], 3: [17, 2, 6]}
    runner.execute(Batch([SeqChunk(s, p, 0, tables[s], False, G) for s, p in prompts.items()]))
    chunks = [decode(s, 20 + s, len(p), tables[s]) for s, p in prompts.items()]  # 3 rows -> 4
    before_k = [k.clone() for k in runner.kv.k]
    before_v = [v.clone() for v in runner.kv.v]

    with torch.inference_mode():
        spans = [(c.start_pos, 1, c.block_table) for c in chunks]
        eager = runner.model.forward(torch.tensor([c.token_ids[0] for c in chunks]),
                                     torch.tensor([c.start_pos for c in chunks]),
                                     build_metadata(spans, bs, "cpu"), runner.kv,
                                     torch.arange(3))
        eager_k = [k.clone() for k in runner.kv.k]
        for k, v, k0, v0 in zip(runner.kv.k, runner.kv.v, before_k, before_v):
            k.copy_(k0)
            v.copy_(v0)
        stage = cg.new_staging(4, cg.table_width(64, bs), bs, scratch)
        cg.pack(stage.numpy(), chunks, cg.bucket_for(3), bs, scratch)
        padded = cg.decode_step(runner.model, runner.kv, stage, torch.arange(4))
    assert padded.shape == (4, tm.VOCAB)
    assert torch.allclose(padded[:3], eager, atol=1e-4, rtol=1e-4)  # un-padded: first n rows
    for k, k_eager, k0 in zip(runner.kv.k, eager_k, before_k):
        assert torch.allclose(k[:scratch], k_eager[:scratch], atol=1e-5)
        assert torch.equal(k[scratch, 1:], k0[scratch, 1:])  # padded rows: slot 0 of scratch only
        assert not torch.equal(k[scratch, 0], k0[scratch, 0])
    runner.execute(Batch([], finished_seq_ids=[1, 2, 3]))


def test_capture_is_never_attempted_on_the_cpu(tmp_path, monkeypatch):
    def no_graphs(*a, **k):
        raise AssertionError("CUDA graph constructed on the CPU")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", no_graphs)
    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(1))
    r = ModelRunner(path, num_blocks=8, num_threads=1, cuda_graphs=True)
    assert r.graphs is None and r.kv.num_blocks == 8  # no scratch block either
    with pytest.raises(ValueError, match="CUDA"):
        cg.DecodeGraphs(r.model, r.kv, buckets=(1,), block_size=16, max_context=128,
                        scratch_block=7, device="cpu")
