"""Paged KV cache bookkeeping: which physical block holds which positions of which sequence.

Blocks are fixed-size (block_size positions). A sequence owns a block table; position p
lives in block_table[p // block_size]. Full blocks are keyed by a chained hash of their
tokens (hash of the previous block's key and this block's tokens), so two sequences with
the same prefix share the same physical blocks, read-only and ref-counted. A block whose
ref count drops to 0 keeps its contents and key and joins the free queue; it is reused by
a later prefix hit, or evicted least-recently-used when a fresh block is needed.

Pure Python (no torch): the runner owns the tensors, this owns the numbers.
"""
from __future__ import annotations

from collections import OrderedDict

from services.engine.sequence import Sequence


def chain_hash(parent: int | None, tokens: list[int]) -> int:
    """Key of a full block: depends on every token before it, not only its own."""
    return hash((parent, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # Blocks with ref 0, least recently freed first (evicted first). Blocks without a
        # key go to the front: nothing can reuse them, so they are taken before cached ones.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[int, int] = {}  # chained hash -> block id

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take (including evictable cached ones)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    # -- prefix cache ----------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of seq's tokens (no refs taken).

        At least one token is left uncomputed so the step that finishes the prompt can
        sample from its logits.
        """
        if not self.enable_prefix_caching or seq.num_computed_tokens:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        blocks: list[int] = []
        parent = None
        for i in range(max_blocks):
            h = seq.block_hashes[i] if i < len(seq.block_hashes) else chain_hash(
                parent, seq.tokens(i * bs, (i + 1) * bs))
            if i == len(seq.block_hashes):
                seq.block_hashes.append(h)
            parent = h
            b = self._cached.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers the keys of seq's blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(chain_hash(parent, seq.tokens(i * bs, (i + 1) * bs)))
        for i in range(seq.num_registered_blocks, full):
            b = seq.block_table[i]
            if self._hash[b] is not None:
                continue
            h = seq.block_hashes[i]
            # Another sequence computed the same block first: keep its copy as the key
            # holder; ours stays private and is freed without a key.
            if h not in self._cached:
                self._cached[h] = b
                self._hash[b] = h
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    # -- allocation ------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = (),
                     reserve: int = 0) -> bool:
        need = self._new_blocks_needed(seq, num_new_tokens, cached)
        revived = sum(1 for b in cached if self._ref[b] == 0)
        return need + revived + reserve <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = (),
                 reserve: int = 0) -> bool:
        """Grows seq's block table to cover num_computed + num_new_tokens positions, first
        adopting `cached` prefix blocks (whose tokens then count as computed).

        Returns False, changing nothing, when that would leave fewer than `reserve` free.
        """
        if not self.can_allocate(seq, num_new_tokens, cached, reserve):
            return False
        for b in cached:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
            seq.block_table.append(b)
        seq.num_computed_tokens += len(cached) * self.block_size
        seq.num_registered_blocks += len(cached)
        for _ in range(self._new_blocks_needed(seq, num_new_tokens, ())):
            b, _ = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:  # evict: its contents are about to be overwritten
                del self._cached[h]
                self._hash[b] = None
            self._ref[b] = 1
            seq.block_table.append(b)
        return True

    def free(self, seq: Sequence) -> None:
        """Drops seq's references; tail blocks are freed first so they are evicted first."""
        for b in reversed(seq.block_table):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._hash[b] is None:
                    self._free.move_to_end(b, last=False)
        seq.block_table.clear()
        seq.num_registered_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Frees seq's blocks beyond those covering num_tokens positions (rejected drafts'
        slots). Those tail blocks are never shared: only full computed blocks are."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            b = seq.block_table.pop()
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._hash[b] is None:
                    self._free.move_to_end(b, last=False)

    def _new_blocks_needed(self, seq: Sequence, num_new_tokens: int, cached) -> int:
        have = len(seq.block_table) + len(cached)
        total = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        return max(0, self.blocks_needed(total) - have)
