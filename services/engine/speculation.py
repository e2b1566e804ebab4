"""Prompt-lookup (n-gram) drafting: guesses a sequence's next tokens by copying what followed
an earlier occurrence of its last tokens, in the prompt or in its own output.

    drafter = NgramDrafter(config)
    drafts = drafter.propose(seq_tokens)           # up to config.num_draft_tokens ids
    ...one step verifies [last token] + drafts...
    drafter.observe(len(drafts), num_accepted)     # adapts: stops drafting when it misses

Code edits, tool calls and quoting answers repeat long spans of their prompt; there one
verification step yields several tokens for the price of about one decode. The drafter keeps
an index of where every bigram of the sequence occurs (built once, extended as tokens
arrive) and picks, among the latest occurrences of the last bigram, the one whose preceding
tokens agree longest with the sequence's tail: an edit that copies a file stays aligned with
the copy it is making, not with the latest line that happens to start the same way.

Adaptive off-switch: an exponential moving average of the accepted share of drafts; below
`min_acceptance` the sequence stops drafting for `retry_after` tokens, then probes again
(the part of an edit that rewrites text is followed by a part that copies again).

Pure Python (no torch): the scheduler owns one drafter per speculating sequence.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculationConfig:
    # Engine switch; requests may opt out, never in when this is off.
    enabled: bool = True
    # Most draft tokens verified per sequence per step.
    num_draft_tokens: int = 8
    # Tokens of the sequence's tail an earlier occurrence must match before it is copied.
    min_match: int = 3
    # Most earlier occurrences of the last bigram compared (the latest ones).
    max_candidates: int = 64
    # Below this moving-average share of accepted drafts, a sequence stops drafting...
    min_acceptance: float = 0.25
    # ...for this many generated tokens, then tries again.
    retry_after: int = 64
    # Most draft tokens in one step across all sequences (verification is not free when
    # many sequences decode together: drafts go to the best-accepting sequences first).
    max_draft_tokens_per_step: int = 64

    def __post_init__(self):
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.min_match < 2:
            raise ValueError(f"min_match must be >= 2, got {self.min_match}")
        if self.max_candidates < 1 or self.retry_after < 1:
            raise ValueError("max_candidates and retry_after must be >= 1")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if self.max_draft_tokens_per_step < 0:
            raise ValueError("max_draft_tokens_per_step must be >= 0")


# Weight of the newest step in the acceptance moving average.
_EMA_WEIGHT = 0.3
# Longest tail compared when ranking occurrences (longer agreements rank equal).
_MAX_SCORE = 32


class NgramDrafter:
    """Per-sequence drafting state: the bigram index and the acceptance average."""

    def __init__(self, config: SpeculationConfig):
        self.config = config
        self._index: dict[tuple[int, int], list[int]] = {}  # bigram -> positions of its 2nd token
        self._indexed = 0  # tokens of the sequence indexed so far
        self.acceptance = 1.0  # moving average of accepted / proposed
        self._paused_until = 0  # sequence length before which no drafts are proposed
        self.proposed = 0
        self.accepted = 0

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(limit, num_draft_tokens) tokens guessed to follow `tokens`."""
        n = min(limit, self.config.num_draft_tokens)
        if n <= 0 or len(tokens) < self._paused_until or len(tokens) < 3:
            return []
        self._extend(tokens)
        last = len(tokens) - 1
        found = self._index.get((tokens[-2], tokens[-1]))
        if not found:
            return []
        best, best_score = -1, 0
        # positions before `last` (the tail itself is indexed too), latest first
        checked = 0
        for p in reversed(found):
            if p >= last:
                continue
            score = _agreement(tokens, p, last)
            if score > best_score:
                best, best_score = p, score
                if score >= _MAX_SCORE:
                    break
            checked += 1
            if checked >= self.config.max_candidates:
                break
        if best_score < self.config.min_match:
            return []
        return tokens[best + 1:best + 1 + n]

    def observe(self, proposed: int, accepted: int, num_tokens: int) -> None:
        """Records one verification; pauses drafting when the average falls too low.
        num_tokens: the sequence's length after the step."""
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.acceptance += _EMA_WEIGHT * (accepted / proposed - self.acceptance)
        if self.acceptance < self.config.min_acceptance:
            self._paused_until = num_tokens + self.config.retry_after
            # the probe after the pause starts from the threshold, so one miss pauses again
            self.acceptance = self.config.min_acceptance

    def _extend(self, tokens: list[int]) -> None:
        index = self._index
        for i in range(max(1, self._indexed), len(tokens)):
            index.setdefault((tokens[i - 1], tokens[i]), []).append(i)
        self._indexed = len(tokens)


def _agreement(tokens: list[int], p: int, last: int) -> int:
    """How many tokens ending at p equal the tokens ending at last (p < last)."""
    n = 0
    while n < _MAX_SCORE and p - n >= 0 and tokens[p - n] == tokens[last - n]:
        n += 1
    return n
