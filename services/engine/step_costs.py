"""What engine steps cost, learned from the runner's timings: the scheduler sizes prompt
chunks under an inter-token latency target with it and verifies only the drafts that pay.

Pure Python (no torch).
"""
from __future__ import annotations


class StepCosts:
    """What steps cost, learned from the runner's timings (moving averages): a decode-only step
    as seconds = base + per_row * decode rows + per_draft_token * draft tokens (least squares
    over moving moments: rows change when requests come and go, drafts every step), and
    seconds per prompt token on top of the decodes. `decode_step` is the plain step (no
    drafts) of the latest decode-only batch."""

    _WEIGHT = 0.3  # of the newest observation
    _FIT_WEIGHT = 0.1  # of the newest decode-only step in the fit
    _MIN_VARIANCE = 0.25  # rows or drafts that vary less than this cannot be told apart
    # Decode steps without drafts after which the draft cost is forgotten (drafting is then
    # free again until it is measured anew): an estimate that says drafts never pay stops all
    # drafting, and without drafts nothing would ever correct it (one slow step during
    # drafting on a busy machine was enough to switch speculation off for good).
    _DRAFT_COST_TTL = 64

    def __init__(self):
        self.decode_step: float | None = None
        self.per_prompt_token: float | None = None
        self.per_draft_token: float | None = None
        self._per_row: float | None = None
        self._steps_without_drafts = 0
        # moving means of R, D, S, RR, DD, RD, RS, DS (rows, drafts, seconds)
        self._m: list[float] | None = None

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float,
                draft_tokens: int = 0) -> None:
        if seconds <= 0:
            return
        if not prompt_tokens:
            self._fit(decode_rows, draft_tokens, seconds)
            return
        if decode_rows:
            if self.decode_step is None:
                return  # cannot split the step between decodes and prompt yet
            seconds -= self.plain_decode(decode_rows) + draft_tokens * (self.per_draft_token or 0.0)
        if seconds > 0:
            self.per_prompt_token = self._avg(self.per_prompt_token, seconds / prompt_tokens)

    def _fit(self, r: int, d: int, s: float) -> None:
        self._steps_without_drafts = 0 if d else self._steps_without_drafts + 1
        if self._steps_without_drafts >= self._DRAFT_COST_TTL:
            self.per_draft_token = None
        x = [r, d, s, r * r, d * d, r * d, r * s, d * s]
        m = x if self._m is None else [a + self._FIT_WEIGHT * (b - a) for a, b in zip(self._m, x)]
        self._m = m
        mr, md, ms, mrr, mdd, mrd, mrs, mds = m
        vr, vd, crd = mrr - mr * mr, mdd - md * md, mrd - mr * md
        crs, cds = mrs - mr * ms, mds - md * ms
        det = vr * vd - crd * crd
        if vd >= self._MIN_VARIANCE:
            if vr >= self._MIN_VARIANCE and det > 0.1 * vr * vd:  # rows and drafts both vary
                self._per_row = max(0.0, (crs * vd - cds * crd) / det)
                self.per_draft_token = max(0.0, (cds * vr - crs * crd) / det)
            else:
                self.per_draft_token = max(0.0, cds / vd)
        self.decode_step = self.plain_decode(r)

    def plain_decode(self, rows: int) -> float:
        """Seconds of a decode-only step of `rows` rows without drafts (best estimate)."""
        mr, md, ms = self._m[0], self._m[1], self._m[2]
        plain = ms - (self.per_draft_token or 0.0) * md + (self._per_row or 0.0) * (rows - mr)
        return max(plain, 0.1 * ms)

    def draft_min_yield(self, decode_rows: int) -> float:
        """Tokens a draft token must be expected to add for a step with `decode_rows` decodes
        to yield as many tokens per second as without it: its cost over the plain step's
        seconds per token. 0 (draft freely) until both costs are known."""
        if not self.per_draft_token or self._m is None or decode_rows <= 0:
            return 0.0
        return self.per_draft_token * decode_rows / self.plain_decode(decode_rows)

    def draft_tokens_within(self, seconds: float, decode_rows: int, prompt_tokens: int = 0) -> int | None:
        """Draft tokens a step of `decode_rows` decodes and `prompt_tokens` prompt tokens can
        add and stay within `seconds` (0 when the step alone takes that long). None until the
        draft cost is known."""
        if not self.per_draft_token or self._m is None or decode_rows <= 0:
            return None
        left = seconds - self.plain_decode(decode_rows) - prompt_tokens * (self.per_prompt_token or 0.0)
        return max(0, int(left / self.per_draft_token))

    def prompt_tokens_within(self, seconds: float) -> int | None:
        """Prompt tokens a step with the current decodes can add and stay within `seconds`,
        but at least half the decodes' time's worth (a third of the step), so new requests
        are not starved when the decodes alone use up the target. None until both costs
        are known."""
        if self.decode_step is None or self.per_prompt_token is None:
            return None
        room = max(seconds - self.decode_step, self.decode_step / 2)
        return int(room / self.per_prompt_token)

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self._WEIGHT * (new - old)
