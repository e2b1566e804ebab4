"""Prompt-lookup (n-gram) drafting: guesses a sequence's next tokens by copying what followed
an earlier occurrence of its last tokens, in the prompt or in its own output.

    drafter = NgramDrafter(config)
    drafts = drafter.propose(seq_tokens, limit)    # up to min(limit, num_draft_tokens) ids
    ...one step verifies [last token] + drafts...
    drafter.observe(len(drafts), num_accepted, num_tokens)   # adapts

Code edits, tool calls and quoting answers repeat long spans of their prompt; there one
verification step yields several tokens for little more than one decode. The drafter keeps an
index of where every bigram (and every token) of the sequence occurs, built once and extended
as tokens arrive, and picks the source to copy from in this order:

- a long match: among the latest occurrences of the last bigram, the one whose preceding
  tokens agree longest with the sequence's tail, when that agreement reaches `strong_match`
  tokens (an edit that copies a file stays aligned with the copy it is making);
- else the continuation of the last copy: the first occurrence of the last bigram, or of the
  last token alone, within `window` tokens after where the last accepted draft came from. A
  tool call that fills a JSON template copies a key, writes its own value, then copies the
  next key: the value breaks every n-gram match, but the next key follows the last copy's
  source;
- else the longest-agreeing occurrence, if it agrees on at least `min_match` tokens.

Without a long match in its own tokens the drafter also searches its tenant's earlier outputs
(output_history.py) and copies from there when that agrees at least as long: a tool call's
values and closing are written by the model, not found in its prompt, but they repeat across
calls of the same tool. The history is searched only while its drafts for this sequence are
accepted at `min_acceptance` or better (after a trial of `_HISTORY_TRIAL` tokens), so a chat
answer that shares nothing with earlier answers stops paying for the lookups.

Draft length follows the evidence: a match that agreed on s tokens drafts s tokens (s + 2 for
a continuation), at most num_draft_tokens, so a weak match risks one or two tokens and a long
copy drafts many.

Adaptive: a draft token's chance to be accepted when the ones before it were is estimated per
kind of proposal (a strong match, a weak one, a continuation, the history) over all the
tenant's sequences (`TenantAcceptance`; accepted tokens / (accepted tokens + rejections), as
moving averages); the scheduler verifies a draft's j-th token only while chance**j pays for
what it adds to the step (`draft_tokens_worth`). `rate` is the same estimate over the
sequence's own drafts. Below `min_acceptance` the sequence stops drafting for
`retry_after` tokens, then probes again (the part of an edit that rewrites text is followed by
a part that copies again); while paused it still copies a strong match as long as its
tenant's strong matches are accepted at least half the time (a tool call's values miss, the
next key or repeated object is copied).

Pure Python (no torch): the scheduler owns one drafter per speculating sequence.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from services.engine.output_history import OutputHistory, Source


@dataclass(frozen=True)
class SpeculationConfig:
    # Engine switch; requests may opt out, never in when this is off.
    enabled: bool = True
    # Most draft tokens verified per sequence per step.
    num_draft_tokens: int = 8
    # Tokens of the sequence's tail an earlier occurrence must match before it is copied
    # (a continuation of the last copy needs only the last token).
    min_match: int = 2
    # A match this long is copied even when the last copy's continuation is elsewhere.
    strong_match: int = 6
    # How far after the last copy's source its continuation is looked for (tokens).
    window: int = 32
    # Most earlier occurrences of the last bigram compared (the latest ones).
    max_candidates: int = 64
    # Below this per-token acceptance estimate a sequence stops drafting...
    min_acceptance: float = 0.15
    # ...for this many generated tokens, then tries again.
    retry_after: int = 32
    # Most draft tokens in one step across all sequences (the scheduler also keeps only the
    # drafts whose expected yield pays for their verification; see scheduler.py).
    max_draft_tokens_per_step: int = 64
    # Decode rows the runner multiplies as one unit (its AMX kernel: 16 rows a tile; 0: each
    # row costs its own): drafts then only fill the free rows of the step's last unit. A draft
    # row past it costs a whole unit and stretches every stream's step; measured in-process on
    # a 2-core AMX Xeon, 64-token prompts and outputs: 16 streams 1.08x the tokens per second
    # and half the p99 inter-token latency (40.7 -> 20.2 ms), 4 streams 1.03x, 1 and 64 alike.
    row_tile: int = 0
    # Drafts also from the tenant's earlier outputs (output_history.py): the last this many
    # per tenant (0: no history)...
    history_outputs: int = 256
    # ...and at most this many of their tokens per tenant...
    history_tokens: int = 65536
    # ...for at most this many tenants (the least recently served is dropped).
    history_tenants: int = 16

    def __post_init__(self):
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.min_match < 2:
            raise ValueError(f"min_match must be >= 2, got {self.min_match}")
        if self.strong_match < self.min_match:
            raise ValueError("strong_match must be >= min_match")
        if self.max_candidates < 1 or self.retry_after < 1 or self.window < 1:
            raise ValueError("max_candidates, retry_after and window must be >= 1")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if self.max_draft_tokens_per_step < 0 or self.row_tile < 0:
            raise ValueError("max_draft_tokens_per_step and row_tile must be >= 0")
        if self.history_outputs < 0 or self.history_tokens < 1 or self.history_tenants < 1:
            raise ValueError("history_outputs must be >= 0, history_tokens and history_tenants >= 1")


# Weight of the newest verification in the acceptance estimates.
_EMA_WEIGHT = 0.1
# ... in the estimates per kind of proposal, shared by all of a tenant's sequences.
_PRIOR_WEIGHT = 0.05


class Acceptance:
    """Moving averages of accepted tokens and of rejections per verification; `rate` is the
    estimated chance that a draft token is accepted when the ones before it were."""

    __slots__ = ("kept", "missed", "_weight")

    def __init__(self, kept: float = 1.0, missed: float = 0.0, weight: float = _EMA_WEIGHT):
        self.kept, self.missed, self._weight = kept, missed, weight

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.missed)

    def observe(self, proposed: int, accepted: int) -> None:
        self.kept += self._weight * (accepted - self.kept)
        self.missed += self._weight * ((accepted < proposed) - self.missed)

    def copy(self, weight: float = _EMA_WEIGHT) -> "Acceptance":
        return Acceptance(self.kept, self.missed, weight)



# What a proposal copies, which says more about its chance than the sequence's record does
# (16 chat and 16 tool-call streams, SmolLM2, tokens accepted per token drafted): a match of
# at least strong_match tokens ("strong") 0.94-0.95, a shorter one ("weak") 0.46-0.58, the
# continuation of the last copy 0.33-0.41, the tenant's earlier outputs ("history") 0.56 for
# tool calls and 0.14 for chat.
KINDS = ("strong", "weak", "continuation", "history")


class TenantAcceptance:
    """Each tenant's acceptance per kind of proposal, over all its sequences (the last
    `max_tenants` tenants served), and the engine's, which a new tenant starts from (certain
    before anything is known). A sequence's draft is verified as far as its kind's chance
    pays: with one estimate per sequence that started certain, every new chat answer drafted
    its short matches at full length until its own misses taught it otherwise, and 16 chat
    streams were slower with speculation than without."""

    def __init__(self, max_tenants: int = 64):
        self._max = max_tenants
        self._engine = {k: Acceptance(weight=_PRIOR_WEIGHT) for k in KINDS}
        self._tenants: dict[str, dict[str, Acceptance]] = {}

    def estimates(self, tenant: str) -> dict[str, Acceptance]:
        """The tenant's live estimates (a drafter of the tenant updates them)."""
        est = self._tenants.pop(tenant, None) or {
            k: a.copy(_PRIOR_WEIGHT) for k, a in self._engine.items()}
        self._tenants[tenant] = est  # the most recent last
        if len(self._tenants) > self._max:
            del self._tenants[next(iter(self._tenants))]
        return est

    def record(self, kind: str, proposed: int, accepted: int) -> None:
        """One verification of any tenant, for the engine's estimates."""
        if proposed > 0:
            self._engine[kind].observe(proposed, accepted)


# Longest tail compared when ranking occurrences (longer agreements rank equal).
_MAX_SCORE = 32
# Extra draft tokens for a continuation of the last copy (its match is one or two tokens).
_CONTINUATION_EXTRA = 2
# History draft tokens verified before their acceptance decides whether to keep searching it.
_HISTORY_TRIAL = 24
# While a sequence's drafting is paused, a strong match is still copied when strong matches
# are accepted at least this often (the tenant's estimate): a tool call pauses on its
# values, written by the model, and then copies the next key or a repeated object.
_PAUSED_STRONG_CHANCE = 0.5


def draft_tokens_worth(rate: float, min_yield: float, n: int) -> int:
    """How many of n draft tokens to verify: the j-th is kept with probability about rate**j,
    so verify while that is at least min_yield (the tokens a draft token must be expected to
    add for the step to yield as many tokens per second as without it)."""
    if min_yield <= 0:
        return n
    j, p = 0, rate
    while j < n and p >= min_yield:
        j += 1
        p *= rate
    return j


class NgramDrafter:
    """Per-sequence drafting state: the n-gram indexes, the last copy's source, and the
    acceptance estimates."""

    def __init__(self, config: SpeculationConfig, history: OutputHistory | None = None,
                 tenant: str = "", estimates: dict[str, Acceptance] | None = None):
        self.config = config
        self._history = history  # the tenant's earlier outputs, searched after the own tokens
        self._tenant = tenant
        self._bigrams: dict[tuple[int, int], list[int]] = {}  # bigram -> positions of its 2nd token
        self._tokens: dict[int, list[int]] = {}  # token -> its positions
        self._indexed = 0  # tokens of the sequence indexed so far
        self._source: int | None = None  # position of the last source token a draft copied and kept
        self._proposed_from: int | None = None  # where the pending proposal copies from
        self._acceptance = Acceptance()  # this sequence's record, for pausing
        # the chance of each kind of proposal (its tenant's; its own without a tenant's)
        self._estimates = estimates if estimates is not None else {
            k: Acceptance(weight=_PRIOR_WEIGHT) for k in KINDS}
        self.kind: str | None = None  # of the pending proposal
        self._paused_until = 0  # sequence length before which no drafts are proposed
        self.proposed = 0
        self.accepted = 0
        self._from_history = False  # the pending proposal came from the history
        self._history_source: Source | None = None  # where the last history draft came from
        self.history_proposed = 0
        self.history_accepted = 0

    @property
    def rate(self) -> float:
        """Estimated chance that a draft token is accepted, given the ones before it were."""
        return self._acceptance.rate

    def chance(self, kind: str) -> float:
        """Estimated chance that a draft token of this kind is accepted when the ones before
        it were."""
        return self._estimates[kind].rate

    def propose(self, tokens: list[int], limit: int, min_yield: float = 0.0) -> list[int]:
        """Up to min(limit, num_draft_tokens) tokens guessed to follow `tokens`, as many as
        their kind's chance makes worth verifying at `min_yield` (`draft_tokens_worth`)."""
        draft = self._propose(tokens, limit)
        if draft:
            draft = draft[:draft_tokens_worth(self.chance(self.kind), min_yield, len(draft))]
        if not draft:
            self._proposed_from, self._from_history, self.kind = None, False, None
        return draft

    def _propose(self, tokens: list[int], limit: int) -> list[int]:
        self._proposed_from, self._from_history, self.kind = None, False, None
        cfg = self.config
        n = min(limit, cfg.num_draft_tokens)
        if n <= 0 or len(tokens) < 3:
            return []
        paused = len(tokens) < self._paused_until
        if paused and self.chance("strong") < _PAUSED_STRONG_CHANCE:
            return []
        self._extend(tokens)
        last = len(tokens) - 1
        best, best_score, follow, follow_score = self._candidates(tokens, last)
        if paused and best_score < cfg.strong_match:
            return []  # paused: only a strong match, copied below
        if best_score < cfg.strong_match and self._history_pays():
            draft, score, source = self._history.propose(self._tenant, tokens, n,
                                                          self._history_source)
            if draft and score >= best_score:
                self._from_history, self._history_source = True, source
                self.kind = "history"
                return draft[:score + _CONTINUATION_EXTRA]
        if best_score >= cfg.strong_match or (follow < 0 and best_score >= cfg.min_match):
            p, length = best, best_score
            self.kind = "strong" if best_score >= cfg.strong_match else "weak"
        elif follow >= 0:
            p, length = follow, follow_score + _CONTINUATION_EXTRA
            self.kind = "continuation"
        else:
            return []
        self._proposed_from = p
        return tokens[p + 1:p + 1 + min(n, length)]

    def _history_pays(self) -> bool:
        """Whether to search the history: until its drafts have had a fair trial, then while
        they are accepted often enough (a chat answer rarely repeats an earlier one)."""
        return self._history is not None and (
            self.history_proposed < _HISTORY_TRIAL
            or self.history_accepted >= self.config.min_acceptance * self.history_proposed)

    def _candidates(self, tokens: list[int], last: int) -> tuple[int, int, int, int]:
        """(best, its agreement, continuation, its agreement); -1 where there is none."""
        cfg = self.config
        src = self._source
        best, best_score, follow, follow_score = -1, 0, -1, 0
        checked = 0
        # positions before `last` (the tail itself is indexed too), latest first
        for p in reversed(self._bigrams.get((tokens[-2], tokens[-1]), ())):
            if p >= last:
                continue
            score = _agreement(tokens, p, last)
            if score > best_score:
                best, best_score = p, score
            if src is not None and src < p <= src + cfg.window:
                follow, follow_score = p, score  # latest first: ends at the nearest after src
            checked += 1
            if checked >= cfg.max_candidates or (best_score >= _MAX_SCORE and src is None):
                break
        if follow < 0 and src is not None:
            found = self._tokens.get(tokens[-1], [])
            i = bisect.bisect_right(found, src)
            if i < len(found) and found[i] <= src + cfg.window and found[i] < last:
                follow, follow_score = found[i], 1
        return best, best_score, follow, follow_score

    def observe(self, proposed: int, accepted: int, num_tokens: int) -> None:
        """Records one verification of the last proposal; pauses drafting when the estimate
        falls too low. num_tokens: the sequence's length after the step."""
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        if self._from_history:
            self.history_proposed += proposed
            self.history_accepted += accepted
            s = self._history_source
            self._history_source = Source(s.output, s.position + accepted)
        if accepted and self._proposed_from is not None:
            self._source = self._proposed_from + accepted
        self._acceptance.observe(proposed, accepted)
        if self.kind is not None:
            self._estimates[self.kind].observe(proposed, accepted)
        floor = self.config.min_acceptance
        if self.rate < floor:
            self._paused_until = num_tokens + self.config.retry_after
            # the probe after the pause starts at the threshold, so one miss pauses again
            self._acceptance = Acceptance(floor, 1.0 - floor)

    def _extend(self, tokens: list[int]) -> None:
        bigrams, singles = self._bigrams, self._tokens
        start = self._indexed
        if start == 0 and tokens:
            singles.setdefault(tokens[0], []).append(0)
            start = 1
        for i in range(start, len(tokens)):
            bigrams.setdefault((tokens[i - 1], tokens[i]), []).append(i)
            singles.setdefault(tokens[i], []).append(i)
        self._indexed = len(tokens)


def _agreement(tokens: list[int], p: int, last: int) -> int:
    """How many tokens ending at p equal the tokens ending at last (p < last)."""
    n = 0
    while n < _MAX_SCORE and p - n >= 0 and tokens[p - n] == tokens[last - n]:
        n += 1
    return n
