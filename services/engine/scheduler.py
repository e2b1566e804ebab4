"""Decides what each engine step computes: continuous batching under one token budget.

Every step: running sequences first (decodes before unfinished prefills, so a long prompt
delays decodes by at most one chunk), then waiting ones are admitted while slots, budget
and KV blocks last. A sequence gets min(remaining tokens, budget left) tokens, which is
chunked prefill, decode (1 token) and recompute after preemption under one rule.

Inter-token latency target (`itl_target_s`): while sequences are decoding, the prompt
tokens computed in the same step are limited to what the learned step costs say fits in
the target (at least MIN_PREFILL_CHUNK tokens and half the decodes' time, so prompts always
progress). Decoding streams then stall for one short chunk, not a whole budget's worth of
prompt, when others arrive. The target yields to a prompt kept waiting (`prompt_wait_s`):
once a prompt that could run has waited that long for its first token, steps take prompt
tokens up to the whole budget until no such prompt is left, so a burst's latecomers (its
requests that arrive after the others started streaming) wait about a second plus their
prefill, not many short chunks beside a growing batch of decodes (32 of 64 streams 2.5 s
late on 2 cores: the last first token 5.0-6.5 s after its request, 2.3-2.9 s with a 1 s bound).

Bursts start together (`burst_hold_s`): when nobody is streaming yet and several prompts
are being prefilled, a prompt that finishes first keeps its last token (and so its first
output token) back until the others are done, as long as the learned costs say the rest
finishes within `burst_hold_s` of the hold starting. Without it the first prompts of a burst
would start decoding at once, and the target above would then cut every later prompt of
the burst into small chunks beside a few decodes (many slow steps, a long tail of first
tokens); with it the burst is prefilled in full steps and decodes as one batch. Only a
tenant's own burst is held: another tenant's lone request streams at once (fairness beats
the burst's throughput).

Policies:
- priority: higher `priority` is scheduled, admitted and kept first; when KV blocks run
  out the lowest-priority (then youngest) running sequence is preempted and recomputed.
  When every slot is taken and sequences wait with a higher priority than some running
  ones, the lowest-priority (then youngest) running sequences give up their slots, one per
  such waiting sequence (recompute preemption), so a premium request waits for one step,
  not for a free-tier stream to finish; a sequence never displaces one of its own priority.
- fair share: among waiting sequences of the top priority, the tenant with the fewest
  running sequences is admitted next (ties: the tenant admitted least recently), FIFO
  within a tenant, so no tenant starves another of the same priority. When every slot is
  taken and a waiting tenant of the top priority runs fewer sequences than its share
  (max_num_seqs / tenants with work at that priority), the tenant running the most beyond
  its share gives up its youngest slot (recompute preemption), so a flooding tenant cannot
  hold every slot while another waits for its first token.

Newcomers first: while sequences decode, a fresh request of a tenant with nothing running
(and a priority no running sequence beats) gets a prompt-only step of its own when the
decodes' step is expected to cost more than its prompt: its first token then waits for the
step in progress and its own prompt, not for another tenant's whole batch beside it. The
decodes wait at most one such step in a row (`_newcomer_step_due`). A newcomer that
arrives while a step runs on the CPU does not wait for it: between two of the step's layers
the engine computes the newcomer's prompt in a step of its own (`schedule_interjection`),
streams its first token, then finishes the step in progress.

Speculative decoding (`speculation`): a decoding sequence may carry draft tokens guessed by
prompt lookup (speculation.py) after its last token; the runner verifies them in the same
step and the sequence advances by the accepted drafts plus one token. Drafts get the budget
left once every running sequence has its tokens and waiting prompts are admitted (they never
delay a prompt), best-accepting sequences first, only as many as are expected to pay for
their verification (learned step costs: `_add_drafts`), and never cause a preemption: when
blocks are short the sequence decodes plainly. The slots of
rejected drafts lie beyond num_computed_tokens, so the next step overwrites them; blocks
that held only rejected drafts are freed at once.

Pure Python (no torch); unit-tested with hand-built runner outputs.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from dataclasses import dataclass, field

from services.engine.block_manager import BlockManager
from services.engine.output_history import OutputHistory
from services.engine.interface import Batch, RunnerOutput, SampledToken, SeqChunk
from services.engine.sequence import FinishReason, SeqStatus, Sequence
from services.engine.speculation import NgramDrafter, SpeculationConfig, TenantAcceptance
from services.engine.step_costs import StepCosts


@dataclass(frozen=True)
class SchedulerConfig:
    # Most sequences running at once (batch rows).
    max_num_seqs: int = 64
    # Tokens computed per step across all sequences (the chunked-prefill budget).
    max_num_batched_tokens: int = 1024
    # Model context: a sequence stops with LENGTH when it fills it.
    max_model_len: int = 2048
    # Free blocks kept back when admitting new sequences, so running ones can grow.
    admission_reserve_blocks: int = 0
    # Seconds a step may take while sequences decode (bounds the prompt tokens beside them);
    # 0: no bound beyond max_num_batched_tokens.
    itl_target_s: float = 0.0
    # Longest a burst's first tokens are held back so the burst starts together; 0: never.
    burst_hold_s: float = 0.0
    # A prompt that has waited this long for its first token (and could run) lifts
    # itl_target_s: the step takes prompt tokens up to the whole budget; 0: never.
    prompt_wait_s: float = 0.0
    # Prompt-lookup speculative decoding (off unless the engine turns it on).
    speculation: SpeculationConfig = SpeculationConfig(enabled=False)

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs so every running"
                             f" sequence can decode each step ({self.max_num_batched_tokens}"
                             f" < {self.max_num_seqs})")
        if self.max_model_len < 2 or self.admission_reserve_blocks < 0:
            raise ValueError("admission_reserve_blocks must be >= 0, max_model_len >= 2")
        if not self.itl_target_s >= 0:
            raise ValueError(f"itl_target_s must be >= 0, got {self.itl_target_s}")
        if not self.burst_hold_s >= 0:
            raise ValueError(f"burst_hold_s must be >= 0, got {self.burst_hold_s}")
        if not self.prompt_wait_s >= 0:
            raise ValueError(f"prompt_wait_s must be >= 0, got {self.prompt_wait_s}")


# Fewest prompt tokens a step computes beside decodes under an inter-token latency target.
MIN_PREFILL_CHUNK = 32
# Share of the inter-token latency target that draft tokens may fill a step up to: steps are
# planned from learned mean costs and a real step varies around its plan, so a step filled to
# the whole target overshoots it about half the time, and a step whose drafts are all rejected
# is a gap of that length in every stream of the batch (16 streams on a 2-core Zen 4 capped at
# AVX2, A/B runs of 3 rounds: p99 inter-token latency 100 / 91 -> 90 / 86 ms at the 100 ms
# target, 6% fewer tokens/s; without the cap 107-109 ms in slow phases with the whole target)
DRAFT_TARGET_SHARE = 0.8


@dataclass
class TokenEvent:
    """One sequence's result from a step: the tokens it gained (none for a prompt chunk;
    several when drafts were accepted), in order."""

    seq: Sequence
    tokens: list[SampledToken]
    num_computed: int  # tokens whose KV this step computed, drafts included (energy)
    num_drafted: int = 0
    num_accepted: int = 0

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager,
                 eos_token_ids: frozenset[int] | set[int] = frozenset()):
        self.config = config
        self.blocks = blocks
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._by_id: dict[int, Sequence] = {}
        self._finished_ids: list[int] = []
        self._tenant_last_admit: dict[str, int] = {}
        self._admit_counter = itertools.count()
        self.num_preemptions = 0
        self.costs = StepCosts()
        self._hold_since: float | None = None  # when the current burst hold began
        self._newcomer_step = False  # the last step was a prompt-only step for newcomers
        spec = config.speculation
        # each tenant's last outputs, drafted from (speculating requests only: see finish)
        self.history = OutputHistory(spec.history_outputs, spec.history_tokens,
                                     spec.history_tenants) if (
            spec.enabled and spec.history_outputs) else None
        self.acceptance = TenantAcceptance()  # each tenant's chance per kind of draft

    # -- requests in and out ------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._by_id:
            raise ValueError(f"sequence {seq.seq_id} already scheduled")
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self._by_id[seq.seq_id] = seq

    def get(self, seq_id: int) -> Sequence | None:
        return self._by_id.get(seq_id)

    def finish(self, seq: Sequence, reason: FinishReason, now: float | None = None) -> None:
        """Ends seq: frees its blocks at once (they return to the pool this step). A
        speculating sequence's complete output (stop or length) joins its tenant's history;
        one that opted out of speculation is neither drafted for nor drafted from."""
        if seq.finished:
            return
        if (self.history is not None and seq.speculation
                and reason in (FinishReason.STOP, FinishReason.LENGTH)):
            self.history.record(seq.tenant_id, seq.output_token_ids)
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_at = now
        del self._by_id[seq.seq_id]
        self._finished_ids.append(seq.seq_id)

    # -- one step -------------------------------------------------------------------------
    def schedule(self, now: float = 0.0) -> Batch:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        chunks: list[SeqChunk] = []
        self._return_borrowed_slots()
        if not self._free_slots_for_priority():
            self._free_a_fair_slot()
        due, self._newcomer_step = self._newcomer_step_due(), False
        if due:
            # a prompt-only step for the newcomers: the decodes wait this one short step
            taken = self._admit(chunks, budget, now, frozenset(), newcomers_only=True)
            if chunks:
                self._newcomer_step = True
                return self._batch(chunks, budget - taken)
        # decodes first, then unfinished prefills; each by priority then age
        self.running.sort(key=lambda s: (s.num_remaining > 1, -s.priority, s.arrival))
        prompt_left = self._prompt_allowance(now)
        hold = self._burst_hold(now)  # the tenants whose prompts hold their first token
        scheduled: set[int] = set()
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.tenant_id in hold and _held(seq):
                i += 1
                continue
            if seq.num_remaining > 1 and prompt_left <= 0:
                break  # the rest are prompts: they wait for a step with room
            n = min(seq.num_remaining, budget, prompt_left if seq.num_remaining > 1 else 1)
            if seq.tenant_id in hold:
                n = _hold_back(seq, n, seq.num_remaining)
            while not self.blocks.allocate(seq, n):
                victim = self._pick_victim(scheduled)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                chunks.append(self._chunk(seq, n, now))
                scheduled.add(seq.seq_id)
                budget -= n
                if n > 1:
                    prompt_left -= n
                i += 1
                continue
            # seq itself was preempted: running[i] is now the next one
        if not preempted and prompt_left > 0:
            budget -= self._admit(chunks, min(budget, prompt_left), now, hold)
        return self._batch(chunks, budget)

    def _batch(self, chunks: list[SeqChunk], budget: int) -> Batch:
        if chunks:
            self._add_drafts(chunks, budget)
        # Ended sequences reach the runner with the next batch that has work.
        finished: list[int] = []
        if chunks:
            finished, self._finished_ids = self._finished_ids, []
        return Batch(chunks=chunks, finished_seq_ids=finished)

    def _add_drafts(self, chunks: list[SeqChunk], budget: int) -> None:
        """Adds draft tokens to this step's decodes, within the budget the step has left, the
        blocks free beyond one per running sequence (drafts never cause a preemption), and
        what pays: a draft token is verified only while its chance to be kept (its kind's
        estimated chance to the power of its place: NgramDrafter.chance) is at least
        `StepCosts.draft_min_yield`, so a step with drafts is expected to yield at least as
        many tokens per second as without them, and within the inter-token latency target
        (`itl_target_s`, as prompt chunks are).
        On one stream a CPU's draft token costs ~a tenth of a decode and most drafts pay; in
        a batch that is already compute-bound each costs about a row of its own, and only
        near-certain ones do. Best-accepting sequences draft first. Where the runner multiplies
        decode rows in units (`SpeculationConfig.row_tile`), drafts fill only the last unit."""
        spec = self.config.speculation
        if not spec.enabled:
            return
        room = min(spec.max_draft_tokens_per_step, budget)
        decodes = [(i, self._by_id[c.seq_id]) for i, c in enumerate(chunks)
                   if c.sample and len(c.token_ids) == 1]
        if self.config.itl_target_s:  # drafts never stretch a step past the latency target
            fits = self.costs.draft_tokens_within(
                self.config.itl_target_s * DRAFT_TARGET_SHARE, len(decodes),
                sum(len(c.token_ids) for c in chunks) - len(decodes))
            room = room if fits is None else min(room, fits)
        if spec.row_tile:  # only the free rows of the decodes' last unit
            room = min(room, -(-len(decodes) // spec.row_tile) * spec.row_tile - len(decodes))
        candidates = [(i, s) for i, s in decodes if s.speculation and _streaming(s)]
        if not candidates or room <= 0:
            return
        for _, s in candidates:
            if s.drafter is None:
                s.drafter = NgramDrafter(spec, self.history, s.tenant_id,
                                         self.acceptance.estimates(s.tenant_id))
        min_yield = self.costs.draft_min_yield(len(decodes))
        candidates.sort(key=lambda c: -c[1].drafter.rate)
        for i, s in candidates:
            if room <= 0:
                break
            # the step yields up to 1 + drafts tokens: stay within max_tokens and the context
            limit = min(room, s.stop.max_tokens - len(s.output_token_ids) - 1,
                        self.config.max_model_len - s.num_tokens)
            draft = s.drafter.propose(s.tokens(0, s.num_tokens), limit, min_yield)
            if draft and self.blocks.allocate(s, 1 + len(draft), reserve=len(self.running)):
                c = chunks[i]
                chunks[i] = dataclasses.replace(c, token_ids=c.token_ids + draft,
                                                num_draft_tokens=len(draft))
                room -= len(draft)

    def _prompt_allowance(self, now: float) -> int:
        """Prompt tokens this step may compute (beside any decodes)."""
        cap = self.config.max_num_batched_tokens
        target = self.config.itl_target_s
        if not target or not any(_streaming(s) for s in self.running) or self._prompt_overdue(now):
            return cap
        fits = self.costs.prompt_tokens_within(target)
        return cap if fits is None else min(cap, max(MIN_PREFILL_CHUNK, fits))

    def _prompt_overdue(self, now: float) -> bool:
        """Whether a prompt this step could compute has waited prompt_wait_s for its first
        token: one being prefilled, or a waiting one while a slot is free."""
        wait = self.config.prompt_wait_s
        if not wait:
            return False
        prompts = [s for s in self.running if not s.output_token_ids and s.num_remaining > 1]
        if len(self.running) < self.config.max_num_seqs:
            prompts += self.waiting
        return any(now - s.arrival >= wait for s in prompts)

    def _burst_hold(self, now: float) -> frozenset[str]:
        """The tenants whose prompts finishing their prefill this step hold their first token
        back: while nobody is streaming yet, the prompt tokens of the burst's top priority
        do not all fit in this step (so nobody waits for lower-priority prompts), and the
        learned cost says they are done within burst_hold_s of the hold starting, each
        tenant with several of the burst's prompts. A tenant's lone request is no part of a
        burst and never waits for another tenant's: it streams at once (and so ends the
        hold; the burst's other prompts then go on in chunks beside it)."""
        cfg = self.config
        per_token = self.costs.per_prompt_token
        if cfg.burst_hold_s and per_token is not None and not any(
                s.output_token_ids for s in self.running):
            burst = self.running + self.waiting[:max(0, cfg.max_num_seqs - len(self.running))]
            top = max((s.priority for s in burst), default=0)
            pending = sum(s.num_remaining for s in burst if s.priority == top)
            since = now if self._hold_since is None else self._hold_since
            if pending > cfg.max_num_batched_tokens and now - since + pending * per_token <= cfg.burst_hold_s:
                self._hold_since = since
                counts = Counter(s.tenant_id for s in burst if s.priority == top)
                return frozenset(t for t, n in counts.items() if n > 1)
        self._hold_since = None
        return frozenset()

    def _is_newcomer(self, seq: Sequence) -> bool:
        """A fresh request (never run) whose whole prompt fits in one step, whose priority is
        not below any running sequence's, of a light tenant: one with nothing running, or
        running less than half what each other running tenant runs (a tenant sending one
        request a second beside another's flood still has its last one streaming)."""
        if (seq.num_computed_tokens or seq.num_preemptions
                or seq.num_remaining > self.config.max_num_batched_tokens
                or any(s.priority > seq.priority for s in self.running)):
            return False
        running = Counter(s.tenant_id for s in self.running)
        own = running.pop(seq.tenant_id, 0)
        return own == 0 or (bool(running) and 2 * own < min(running.values()))

    def schedule_interjection(self, now: float) -> Batch:
        """A prompt-only step for a newcomer (`_is_newcomer`) to compute between the layers of
        the step in progress, whose batch keeps its rows and blocks: its first token then
        waits for its own prompt only, not for the rest of that step as well. The running
        streams lose nothing to it: they would wait for the newcomer's prompt in the next
        step anyway (in a newcomers-first step, or beside it). Never preempts, drafts
        nothing; empty when the next waiting sequence is not a newcomer."""
        if (not self.waiting or len(self.running) > self.config.max_num_seqs
                or not self._is_newcomer(self._next_waiting())):
            return Batch(chunks=[])
        chunks: list[SeqChunk] = []
        # With every slot taken the newcomer borrows one: the step in progress still writes
        # every running sequence's blocks, so the fair-share preemption that makes room for
        # it waits for the next regular step (`_return_borrowed_slots`).
        self._admit(chunks, self.config.max_num_batched_tokens, now, frozenset(),
                    newcomers_only=True, slots=self.config.max_num_seqs + 1)
        # ended sequences' ids wait for the next regular batch
        return Batch(chunks=chunks)

    def _return_borrowed_slots(self) -> None:
        """Back within max_num_seqs after an interjection borrowed a slot: the tenant running
        the most gives up its lowest-priority, youngest sequence (recompute preemption), as
        the fair share would have made it do for the newcomer."""
        while len(self.running) > self.config.max_num_seqs:
            heavy = Counter(s.tenant_id for s in self.running).most_common(1)[0][0]
            self._preempt(min((s for s in self.running if s.tenant_id == heavy),
                              key=lambda s: (s.priority, -s.arrival)))

    def _newcomer_step_due(self) -> bool:
        """Whether this step computes only newcomers' prompts (`_is_newcomer`), without the
        running decodes: a slot is free, sequences are streaming, the last step was not one
        (decodes wait at most one such step in a row), and the decodes' step is expected to
        take longer than the newcomers' prompt alone, so the newcomer's first token comes a
        decode step sooner than beside them. A tenant's first request then waits for the
        step in progress and its own prompt, not for another tenant's whole batch."""
        if (self._newcomer_step or not self.waiting
                or len(self.running) >= self.config.max_num_seqs
                or not any(_streaming(s) for s in self.running)):
            return False
        costs = self.costs
        if costs.decode_step is None or costs.per_prompt_token is None:
            return False
        nxt = self._next_waiting()
        if not self._is_newcomer(nxt):
            return False
        rows = sum(1 for s in self.running if _streaming(s))
        # what its prompt computes: a prefix cached already (the same system prompt, the
        # tenant's earlier turns) costs nothing
        cached = len(self.blocks.find_cached_prefix(nxt)) * self.blocks.block_size
        return costs.plain_decode(rows) > (nxt.num_remaining - cached) * costs.per_prompt_token

    def _admit(self, chunks: list[SeqChunk], budget: int, now: float,
               hold: frozenset[str], newcomers_only: bool = False, slots: int | None = None) -> int:
        """Admits waiting sequences into this step (while fewer than `slots`, by default
        max_num_seqs, run); returns the tokens they take."""
        cfg = self.config
        start = budget
        slots = cfg.max_num_seqs if slots is None else slots
        while self.waiting and budget > 0 and len(self.running) < slots:
            seq = self._next_waiting()
            if newcomers_only and not self._is_newcomer(seq):
                break
            cached = self.blocks.find_cached_prefix(seq)
            left = seq.num_remaining - len(cached) * self.blocks.block_size
            n = min(left, budget)
            if seq.tenant_id in hold:
                n = _hold_back(seq, n, left)
            # the reserve is for running sequences to grow into; an idle engine needs none
            reserve = cfg.admission_reserve_blocks if self.running else 0
            if not self.blocks.allocate(seq, n, cached, reserve=reserve):
                break
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._tenant_last_admit[seq.tenant_id] = next(self._admit_counter)
            chunks.append(self._chunk(seq, n, now))
            budget -= n
        return start - budget

    def _next_waiting(self) -> Sequence:
        top = max(s.priority for s in self.waiting)
        running_per_tenant: dict[str, int] = {}
        for s in self.running:
            running_per_tenant[s.tenant_id] = running_per_tenant.get(s.tenant_id, 0) + 1
        return min((s for s in self.waiting if s.priority == top),
                   key=lambda s: (running_per_tenant.get(s.tenant_id, 0),
                                  self._tenant_last_admit.get(s.tenant_id, -1), s.arrival))

    def _free_slots_for_priority(self) -> bool:
        """With every slot taken, preempts the lowest-priority (then youngest) running
        sequences, one per waiting sequence of a higher priority; True if any was."""
        if not self.waiting or len(self.running) < self.config.max_num_seqs:
            return False
        top = max(s.priority for s in self.waiting)
        urgent = sum(1 for s in self.waiting if s.priority == top)
        lower = sorted((s for s in self.running if s.priority < top),
                       key=lambda s: (s.priority, -s.arrival))
        for victim in lower[:urgent]:
            self._preempt(victim)
        return bool(lower)

    def _free_a_fair_slot(self) -> None:
        """With every slot taken, preempts the youngest sequence of the tenant furthest over
        its share when a waiting tenant of the top priority is under its share."""
        if not self.waiting or len(self.running) < self.config.max_num_seqs:
            return
        top = max(s.priority for s in self.waiting)
        running = Counter(s.tenant_id for s in self.running if s.priority <= top)
        if not running:
            return  # every slot is a higher priority's: nothing of this priority to even out
        tenants = set(running) | {s.tenant_id for s in self.waiting if s.priority == top}
        share = self.config.max_num_seqs // len(tenants)
        if not any(s.priority == top and running[s.tenant_id] < share for s in self.waiting):
            return
        heavy, held = running.most_common(1)[0]
        if held > share:
            self._preempt(max((s for s in self.running
                               if s.tenant_id == heavy and s.priority <= top),
                              key=lambda s: s.arrival))

    def _pick_victim(self, scheduled: set[int]) -> Sequence:
        """Lowest priority, then youngest, among running sequences not yet in this batch."""
        candidates = [s for s in self.running if s.seq_id not in scheduled]
        return min(candidates, key=lambda s: (s.priority, -s.arrival))

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop its KV, send it back to the head of the queue."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, seq)

    def _chunk(self, seq: Sequence, n: int, now: float) -> SeqChunk:
        start = seq.num_computed_tokens
        if seq.first_scheduled_at is None:
            seq.first_scheduled_at = now
        return SeqChunk(seq_id=seq.seq_id, token_ids=seq.tokens(start, start + n),
                        start_pos=start, block_table=seq.block_table,
                        sample=start + n == seq.num_tokens, sampling=seq.sampling,
                        prompt_token_ids=seq.prompt_token_ids,
                        output_token_ids=seq.output_token_ids)

    def update(self, batch: Batch, output: RunnerOutput, now: float = 0.0) -> list[TokenEvent]:
        """Applies a step's results: advances progress, appends sampled tokens, and ends
        sequences on EOS, a stop token id, max_tokens or a full context."""
        events: list[TokenEvent] = []
        decodes = [c for c in batch.chunks if len(c.token_ids) - c.num_draft_tokens == 1]
        prompt_tokens = sum(len(c.token_ids) for c in batch.chunks) - sum(
            len(c.token_ids) for c in decodes)
        self.costs.observe(len(decodes), prompt_tokens, output.seconds,
                           sum(c.num_draft_tokens for c in batch.chunks))
        for chunk in batch.chunks:
            seq = self._by_id.get(chunk.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue
            n = len(chunk.token_ids)
            if not chunk.sample:
                seq.num_computed_tokens += n
                self.blocks.cache_full_blocks(seq)
                events.append(TokenEvent(seq, [], n))
                continue
            accepted = output.accepted.get(chunk.seq_id, [])
            gained: list[SampledToken] = []
            reason = None
            for t in (*accepted, output.sampled[chunk.seq_id]):
                seq.output_token_ids.append(t.token_id)
                gained.append(t)
                reason = self._stop_reason(seq, t.token_id)
                if reason is not None:
                    break  # tokens after a stop are dropped (never streamed nor billed)
            # KV is valid up to the last accepted draft: every known token but the newest
            seq.num_computed_tokens = seq.num_tokens - 1
            self.blocks.cache_full_blocks(seq)
            if chunk.num_draft_tokens:
                self.blocks.trim(seq, seq.num_tokens)
                self.acceptance.record(seq.drafter.kind, chunk.num_draft_tokens, len(accepted))
                seq.drafter.observe(chunk.num_draft_tokens, len(accepted), seq.num_tokens)
            if seq.first_token_at is None:
                seq.first_token_at = now
            seq.last_token_at = now
            if reason is not None:
                self.finish(seq, reason, now)
            events.append(TokenEvent(seq, gained, n, chunk.num_draft_tokens, len(accepted)))
        return events

    def _stop_reason(self, seq: Sequence, tok: int) -> FinishReason | None:
        stop = seq.stop
        if tok in stop.stop_token_ids or (not stop.ignore_eos and tok in self.eos_token_ids):
            return FinishReason.STOP
        if len(seq.output_token_ids) >= stop.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None


def _streaming(seq: Sequence) -> bool:
    """Decoding one token a step: its stream has started."""
    return seq.num_remaining == 1 and bool(seq.output_token_ids)


def _held(seq: Sequence) -> bool:
    """A prompt held one token short of its end by a burst hold."""
    return seq.num_remaining == 1 and not seq.output_token_ids


def _hold_back(seq: Sequence, n: int, left: int) -> int:
    """n of the `left` tokens seq still needs, or one less when that would finish its prompt
    (and sample its first token)."""
    return n - 1 if 1 < n == left and not seq.output_token_ids else n
