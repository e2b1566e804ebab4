"""Drafts from a tenant's earlier outputs: the last completions of each tenant, searched for
what followed the sequence's last tokens (suffix decoding over a bounded history).

    history = OutputHistory(max_completions=256, max_tokens=65536, max_tenants=16)
    history.record(tenant, output_token_ids)          # when a sequence ends
    draft, agreement = history.propose(tenant, tokens, n)

A tool call fills the same schema for every order: the keys come from the prompt, but the
values the model writes itself (a made-up date, an id, a description, the closing of the
object) repeat across calls of one tool, and no prompt holds them. Earlier answers do.

Bounds: per tenant the last `max_completions` outputs and at most `max_tokens` tokens
(oldest evicted first); at most `max_tenants` tenants hold a history (the least recently
used is dropped). A tenant's drafts and lookup cost depend only on its own outputs, never on
another tenant's text; the one thing others can change is whether the tenant's history is
still held, when more than `max_tenants` other tenants were served since it last was.

Each output is indexed by its trigrams (trigram -> positions of its third token); a lookup
compares the latest occurrences of the sequence's last trigram, newest output first, and
keeps the one whose preceding tokens agree longest with the sequence's tail.

Pure Python (no torch): the scheduler owns one, its drafters read it.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

# Tokens of the tail a history match is keyed on (and must agree on at least).
KEY_TOKENS = 3
# Longest tail compared when ranking occurrences.
_MAX_SCORE = 32


@dataclass(eq=False)
class _Output:
    tokens: list[int]
    index: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def __post_init__(self):
        t = self.tokens
        for i in range(KEY_TOKENS - 1, len(t) - 1):  # the last token has nothing after it
            self.index.setdefault(tuple(t[i - KEY_TOKENS + 1:i + 1]), []).append(i)


@dataclass(frozen=True)
class Source:
    """Where a draft was copied from: an output and the position of the token before it."""

    output: _Output
    position: int


@dataclass
class _TenantHistory:
    outputs: deque[_Output] = field(default_factory=deque)
    num_tokens: int = 0


class OutputHistory:
    """The last outputs of each tenant, bounded, searchable for drafts."""

    def __init__(self, max_completions: int = 256, max_tokens: int = 65536,
                 max_tenants: int = 16, max_candidates: int = 64, window: int = 32):
        if min(max_completions, max_tokens, max_tenants, max_candidates) < 1:
            raise ValueError("OutputHistory bounds must be >= 1")
        self.max_completions = max_completions
        self.max_tokens = max_tokens
        self.max_tenants = max_tenants
        self.max_candidates = max_candidates
        self.window = window
        self._tenants: OrderedDict[str, _TenantHistory] = OrderedDict()

    def record(self, tenant: str, tokens: list[int]) -> None:
        """Adds a finished output to the tenant's history, evicting its oldest beyond the
        bounds (an output longer than max_tokens keeps its last max_tokens tokens)."""
        if len(tokens) <= KEY_TOKENS:
            return
        h = self._touch(tenant)
        if h is None:
            h = self._tenants[tenant] = _TenantHistory()
            while len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)
        out = _Output(list(tokens[-self.max_tokens:]))
        h.outputs.append(out)
        h.num_tokens += len(out.tokens)
        while len(h.outputs) > self.max_completions or h.num_tokens > self.max_tokens:
            h.num_tokens -= len(h.outputs.popleft().tokens)

    def propose(self, tenant: str, tokens: list[int], n: int,
                after: Source | None = None) -> tuple[list[int], int, Source | None]:
        """Up to n tokens that followed the tail of `tokens` in the tenant's history, how many
        tail tokens that occurrence agreed on, and where it is (for `after`). Without a
        match of KEY_TOKENS tokens, the continuation of `after` (the last draft's source):
        the first occurrence of the last token within `window` tokens after it, agreeing on
        that one token. ([], 0, None) when nothing matched."""
        h = self._touch(tenant)
        if h is None or n <= 0 or len(tokens) < KEY_TOKENS:
            return [], 0, None
        key = tuple(tokens[-KEY_TOKENS:])
        best: _Output | None = None
        best_p, best_score, checked = -1, 0, 0
        for out in reversed(h.outputs):
            for p in reversed(out.index.get(key, ())):
                score = _agreement(tokens, out.tokens, p)
                if score > best_score:
                    best, best_p, best_score = out, p, score
                checked += 1
                if checked >= self.max_candidates or best_score >= _MAX_SCORE:
                    break
            else:
                continue
            break
        if best is None and after is not None and after.output in h.outputs:
            src, start = after.output.tokens, after.position + 1
            try:
                best_p = src.index(tokens[-1], start, min(len(src) - 1, start + self.window))
                best, best_score = after.output, 1
            except ValueError:
                pass
        if best is None:
            return [], 0, None
        return best.tokens[best_p + 1:best_p + 1 + n], best_score, Source(best, best_p)

    def num_outputs(self, tenant: str) -> int:
        h = self._tenants.get(tenant)
        return len(h.outputs) if h else 0

    def num_tokens(self, tenant: str) -> int:
        h = self._tenants.get(tenant)
        return h.num_tokens if h else 0

    @property
    def tenants(self) -> list[str]:
        """Tenants holding a history, least recently used first."""
        return list(self._tenants)

    def _touch(self, tenant: str) -> _TenantHistory | None:
        h = self._tenants.get(tenant)
        if h is not None:
            self._tenants.move_to_end(tenant)
        return h


def _agreement(tokens: list[int], src: list[int], p: int) -> int:
    """How many tokens ending at src[p] equal the last tokens of `tokens`."""
    n, last = 0, len(tokens) - 1
    while n < _MAX_SCORE and p - n >= 0 and n <= last and src[p - n] == tokens[last - n]:
        n += 1
    return n
