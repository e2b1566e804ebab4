"""Prefix affinity: send a prompt to the replica that last served its longest known prefix,
whose prefix cache most likely still holds it (the engines key cached KV blocks by a chained
hash of their tokens, so a repeated prefix costs no prefill there).

Keys are chained hashes of the prompt's full blocks of `block_tokens` ids (the engines' KV
block size), scoped by tenant and version, over at most `max_blocks` blocks; a table of the
`capacity` most recently used keys maps each to the replica it was sent to. A match shorter
than `min_blocks` is ignored: a chat template's opening is the same for every chat and would
pin all of them to one replica.

The cached replica is kept unless it is much busier than the least loaded one: its score
(routing.Router.score) may be up to `slack` times the least one's, or up to `balance_tokens`
above it, whichever allows more.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Collection, Sequence


@dataclass(frozen=True)
class AffinityPolicy:
    block_tokens: int = 16
    min_blocks: int = 2
    max_blocks: int = 64
    capacity: int = 65536
    slack: float = 2.0
    balance_tokens: float = 4096.0

    def __post_init__(self):
        if self.block_tokens < 1 or not 1 <= self.min_blocks <= self.max_blocks:
            raise ValueError("affinity needs block_tokens >= 1 and 1 <= min_blocks <= max_blocks")
        if self.capacity < 1 or self.slack < 1 or self.balance_tokens < 0:
            raise ValueError("affinity needs capacity >= 1, slack >= 1, balance_tokens >= 0")

    def keeps(self, cached_score: float, least_score: float) -> bool:
        """Whether the replica holding the prefix is not much busier than the least loaded."""
        return cached_score <= max(self.slack * least_score, least_score + self.balance_tokens)


@dataclass(frozen=True)
class Match:
    endpoint: str
    blocks: int  # full blocks of the prompt it served before


class PrefixAffinity:
    def __init__(self, policy: AffinityPolicy = AffinityPolicy()):
        self.policy = policy
        self._table: OrderedDict[int, str] = OrderedDict()

    def keys(self, scope: str, prompt_ids: Sequence[int]) -> list[int]:
        """One chained key per full block of the prompt (up to max_blocks), first block first."""
        size = self.policy.block_tokens
        n = min(len(prompt_ids) // size, self.policy.max_blocks)
        out, parent = [], hash(scope)
        for b in range(n):
            parent = hash((parent, tuple(prompt_ids[b * size:(b + 1) * size])))
            out.append(parent)
        return out

    def match(self, keys: Sequence[int], candidates: Collection[str]) -> Match | None:
        """The candidate that served the longest prefix of `keys` (at least min_blocks)."""
        for depth in range(len(keys), self.policy.min_blocks - 1, -1):
            endpoint = self._table.get(keys[depth - 1])
            if endpoint is not None and endpoint in candidates:
                return Match(endpoint, depth)
        return None

    def remember(self, keys: Sequence[int], endpoint: str) -> None:
        for k in keys[self.policy.min_blocks - 1:]:
            self._table[k] = endpoint
            self._table.move_to_end(k)
        while len(self._table) > self.policy.capacity:
            self._table.popitem(last=False)

    def __len__(self) -> int:
        return len(self._table)
