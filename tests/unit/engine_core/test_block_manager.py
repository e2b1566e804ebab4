"""Block manager: allocation, freeing, prefix cache hits, ref counts, LRU eviction."""
from __future__ import annotations

import pytest

from services.engine.block_manager import BlockManager
from tests.unit.engine_core.fakes import make_seq


def test_allocate_covers_tokens_and_free_returns_every_block():
    bm = BlockManager(10, 4)
    s = make_seq(1, 9)
    assert bm.allocate(s, 9)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    s.num_computed_tokens = 9
    assert bm.allocate(s, 1)  # position 9 fits the third block
    assert len(s.block_table) == 3
    s.num_computed_tokens = 12
    assert bm.allocate(s, 1)
    assert len(s.block_table) == 4
    bm.free(s)
    assert bm.num_free_blocks == 10 and s.block_table == []


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(3, 4)
    s = make_seq(1, 20)
    assert not bm.allocate(s, 20)
    assert s.block_table == [] and bm.num_free_blocks == 3
    assert not bm.allocate(make_seq(2, 8), 8, reserve=2)
    assert bm.num_free_blocks == 3


def test_rejects_bad_geometry():
    with pytest.raises(ValueError):
        BlockManager(0, 16)


def _compute(bm: BlockManager, seq, n=None):
    n = seq.num_remaining if n is None else n
    cached = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, n - len(cached) * bm.block_size, cached)
    seq.num_computed_tokens = seq.num_computed_tokens + n - len(cached) * bm.block_size
    bm.cache_full_blocks(seq)
    return cached


def test_same_prefix_shares_full_blocks_read_only():
    bm = BlockManager(20, 4)
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks + 2
    a = make_seq(1, prompt=prompt)
    _compute(bm, a)
    b = make_seq(2, prompt=prompt + [99])
    hits = _compute(bm, b)
    assert hits == a.block_table[:3]
    assert all(bm.ref_count(x) == 2 for x in hits)
    # the partial block is never shared
    assert a.block_table[3] != b.block_table[3]
    bm.free(a)
    assert all(bm.ref_count(x) == 1 for x in hits)
    bm.free(b)
    assert bm.num_free_blocks == 20


def test_identical_prompt_leaves_last_token_to_compute():
    bm = BlockManager(20, 4)
    prompt = list(range(1, 13))  # exactly 3 blocks
    _compute(bm, make_seq(1, prompt=prompt))
    b = make_seq(2, prompt=prompt)
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2  # the third block holds the token that must be recomputed


def test_hash_is_chained_not_per_block():
    bm = BlockManager(20, 4)
    _compute(bm, make_seq(1, prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # the second block's tokens match but the first block differs: no hit
    other = make_seq(2, prompt=[9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert bm.find_cached_prefix(other) == []


def test_freed_cached_blocks_survive_until_evicted_least_recently_used_first():
    bm = BlockManager(6, 4)
    old = make_seq(1, prompt=list(range(1, 10)))    # blocks: 2 full + 1 partial
    _compute(bm, old)
    bm.free(old)
    new = make_seq(2, prompt=list(range(100, 109)))
    _compute(bm, new)
    bm.free(new)
    assert bm.num_free_blocks == 6
    # both prefixes are still cached
    assert len(bm.find_cached_prefix(make_seq(3, prompt=list(range(1, 10))))) == 2
    # taking 4 fresh blocks uses the 2 keyless ones, then evicts `old`'s blocks (freed first)
    filler = make_seq(4, prompt=[7] * 16)
    assert bm.allocate(filler, 16)
    assert bm.find_cached_prefix(make_seq(5, prompt=list(range(1, 10)))) == []
    assert len(bm.find_cached_prefix(make_seq(6, prompt=list(range(100, 109))))) == 2


def test_reviving_a_freed_cached_block_takes_it_off_the_free_queue():
    bm = BlockManager(4, 4)
    a = make_seq(1, prompt=list(range(1, 10)))
    _compute(bm, a)
    bm.free(a)
    b = make_seq(2, prompt=list(range(1, 10)))
    hits = _compute(bm, b)
    assert len(hits) == 2 and bm.num_free_blocks == 1
    # the only free block cannot be one b uses
    c = make_seq(3, prompt=[500, 501, 502])
    assert bm.allocate(c, 3)
    assert not set(c.block_table) & set(b.block_table)
