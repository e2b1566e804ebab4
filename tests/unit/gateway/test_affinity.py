"""Prefix keys and the replica table of prefix affinity."""
from __future__ import annotations

from services.gateway.affinity import AffinityPolicy, PrefixAffinity


def test_keys_chain_full_blocks_so_a_shared_prefix_shares_its_keys():
    a = PrefixAffinity(AffinityPolicy(block_tokens=4, min_blocks=1, max_blocks=8))
    k1 = a.keys("t/m/v", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # two full blocks, one partial
    k2 = a.keys("t/m/v", [1, 2, 3, 4, 5, 6, 7, 0])
    assert len(k1) == 2 and len(k2) == 2
    assert k1[0] == k2[0] and k1[1] != k2[1]
    assert a.keys("other/m/v", [1, 2, 3, 4]) != k1[:1]  # scoped
    assert len(a.keys("t/m/v", list(range(100)))) == 8  # max_blocks


def test_the_longest_known_prefix_among_the_candidates_wins():
    a = PrefixAffinity(AffinityPolicy(block_tokens=4, min_blocks=1))
    short, long = a.keys("s", [1, 2, 3, 4]), a.keys("s", [1, 2, 3, 4, 5, 6, 7, 8])
    a.remember(short, "h:1")
    a.remember(long, "h:2")  # h:2 now owns the first block too
    a.remember(short, "h:1")
    m = a.match(a.keys("s", [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9]), {"h:1", "h:2"})
    assert (m.endpoint, m.blocks) == ("h:2", 2)
    m = a.match(long, {"h:1"})  # h:2 is not a candidate (ejected, other version)
    assert (m.endpoint, m.blocks) == ("h:1", 1)
    assert a.match(a.keys("s", [9, 9, 9, 9]), {"h:1", "h:2"}) is None


def test_matches_shorter_than_min_blocks_are_ignored():
    a = PrefixAffinity(AffinityPolicy(block_tokens=4, min_blocks=2))
    template = [1, 2, 3, 4]
    a.remember(a.keys("s", template + [5, 6, 7, 8]), "h:1")
    assert a.match(a.keys("s", template + [0, 0, 0, 0]), {"h:1"}) is None
    assert a.match(a.keys("s", template + [5, 6, 7, 8, 1]), {"h:1"}).endpoint == "h:1"


def test_the_table_keeps_the_most_recently_used_keys():
    a = PrefixAffinity(AffinityPolicy(block_tokens=1, min_blocks=1, capacity=3))
    a.remember(a.keys("s", [1, 2]), "h:1")
    a.remember(a.keys("s", [7, 8]), "h:2")
    assert len(a) == 3
    assert a.match(a.keys("s", [1]), {"h:1"}) is None  # oldest dropped
    assert a.match(a.keys("s", [7, 8]), {"h:2"}).blocks == 2


def test_keeps_allows_a_factor_or_an_absolute_margin_whichever_is_larger():
    p = AffinityPolicy(slack=2.0, balance_tokens=100)
    assert p.keeps(101, 1) and not p.keeps(102, 1)
    assert p.keeps(2000, 1000) and not p.keeps(2001, 1000)
