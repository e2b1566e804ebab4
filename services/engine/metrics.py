"""Prometheus metrics of the engine (`tokenserve_engine_*`), fed from the step thread.

Metric objects live at module level, once per process, as prometheus_client expects;
`EngineMetrics` is the observer the engine core calls after each step and on each finish.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.engine.load import LoadWindow
from services.engine.scheduler import TokenEvent
from services.engine.sequence import Sequence

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2, 5, 10, 30)

TTFT = Histogram("tokenserve_engine_time_to_first_token_seconds",
                 "Arrival at the engine to the first generated token", buckets=_LATENCY)
ITL = Histogram("tokenserve_engine_inter_token_latency_seconds",
                "Time between consecutive tokens of one request", buckets=_LATENCY)
QUEUE = Histogram("tokenserve_engine_queue_seconds",
                  "Arrival at the engine to the first scheduled step", buckets=_LATENCY)
E2E = Histogram("tokenserve_engine_request_seconds", "Arrival to the last token",
                buckets=_LATENCY)
STEP = Histogram("tokenserve_engine_step_seconds", "Duration of one engine step",
                 buckets=_LATENCY)
RUNNING = Gauge("tokenserve_engine_running_requests", "Requests in the running batch")
WAITING = Gauge("tokenserve_engine_waiting_requests", "Requests waiting to be scheduled")
BLOCKS_USED = Gauge("tokenserve_engine_kv_blocks_used", "KV cache blocks in use")
BLOCKS_FREE = Gauge("tokenserve_engine_kv_blocks_free",
                    "KV cache blocks free (including evictable prefix-cache blocks)")
PREFIX_HIT_RATE = Gauge("tokenserve_engine_prefix_cache_hit_rate",
                        "Prompt tokens served from the prefix cache / prompt tokens, since start")
PROMPT_TOKENS = Counter("tokenserve_engine_prompt_tokens_total", "Prompt tokens admitted")
CACHED_TOKENS = Counter("tokenserve_engine_cached_prompt_tokens_total",
                        "Prompt tokens served from the prefix cache")
GENERATED = Counter("tokenserve_engine_generated_tokens_total",
                    "Tokens generated (rate() gives tokens per second)")
PREEMPTIONS = Counter("tokenserve_engine_preemptions_total",
                      "Running requests preempted (recomputed) when KV blocks ran out")
FINISHED = Counter("tokenserve_engine_requests_total", "Requests ended, by finish reason",
                   ["finish_reason"])
DRAFTED = Counter("tokenserve_engine_draft_tokens_proposed_total",
                  "Draft tokens verified by speculative decoding (prompt lookup)")
ACCEPTED = Counter("tokenserve_engine_draft_tokens_accepted_total",
                   "Draft tokens the model agreed with (each saved a step)")
ACCEPTANCE = Histogram("tokenserve_engine_draft_acceptance_rate",
                       "Accepted / proposed draft tokens of each finished request that drafted",
                       buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0))
TOKENS_PER_STEP = Histogram("tokenserve_engine_tokens_per_step",
                            "Tokens one decoding request gained in one step (>1: accepted drafts)",
                            buckets=(1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17))
ENERGY = Counter("tokenserve_engine_energy_joules_total",
                 "Joules attributed to requests (estimated when no counter is readable)")
TOKENS_PER_JOULE = Gauge("tokenserve_engine_tokens_per_joule",
                         "Prompt + completion tokens per joule (tokens per watt-second) of the"
                         " requests finished since start, as the meter counts them")


class EngineMetrics:
    """Observer for EngineCore: called on the step thread only. `window` (when given) gets
    the same TTFT, inter-token and token-count observations, for the load reports."""

    def __init__(self, window: LoadWindow | None = None):
        self.window = window
        self._last_token: dict[int, float] = {}
        self._preemptions = 0
        self._prompt = 0
        self._cached = 0
        self._energy_tokens = 0
        self._joules = 0.0

    def on_step(self, core, events: list[TokenEvent], seconds: float) -> None:
        STEP.observe(seconds)
        generated = drafted = accepted = 0
        for ev in events:
            seq = ev.seq
            if not ev.tokens:
                continue
            generated += len(ev.tokens)
            drafted += ev.num_drafted
            accepted += ev.num_accepted
            now = seq.last_token_at
            prev = self._last_token.get(seq.seq_id)
            if prev is None:  # first token
                ttft = max(0.0, seq.first_token_at - seq.arrival)
                TTFT.observe(ttft)
                QUEUE.observe(max(0.0, (seq.first_scheduled_at or now) - seq.arrival))
                self._admitted(seq)
                if self.window is not None:
                    self.window.add_ttft(ttft, now)
            else:
                ITL.observe(max(0.0, now - prev))
                TOKENS_PER_STEP.observe(len(ev.tokens))
                if self.window is not None:
                    self.window.add_itl(max(0.0, now - prev), now)
            if not seq.finished:
                self._last_token[seq.seq_id] = now
        GENERATED.inc(generated)
        if self.window is not None and events:
            self.window.add_tokens(generated, core.clock())
        if drafted:
            DRAFTED.inc(drafted)
            ACCEPTED.inc(accepted)
        sched = core.scheduler
        if sched.num_preemptions > self._preemptions:
            PREEMPTIONS.inc(sched.num_preemptions - self._preemptions)
            self._preemptions = sched.num_preemptions
        self.gauges(sched)

    def gauges(self, sched) -> None:
        RUNNING.set(sched.num_running)
        WAITING.set(sched.num_waiting)
        BLOCKS_USED.set(sched.blocks.num_used_blocks)
        BLOCKS_FREE.set(sched.blocks.num_free_blocks)

    def on_finish(self, seq: Sequence) -> None:
        self._last_token.pop(seq.seq_id, None)
        FINISHED.labels(seq.finish_reason.value if seq.finish_reason else "unknown").inc()
        if seq.finished_at is not None:
            E2E.observe(max(0.0, seq.finished_at - seq.arrival))
        if seq.energy_joules > 0:
            ENERGY.inc(seq.energy_joules)
            self._energy_tokens += seq.num_prompt_tokens + len(seq.output_token_ids)
            self._joules += seq.energy_joules
            TOKENS_PER_JOULE.set(self._energy_tokens / self._joules)
        d = seq.drafter
        if d is not None and d.proposed:
            ACCEPTANCE.observe(d.accepted / d.proposed)

    def _admitted(self, seq: Sequence) -> None:
        PROMPT_TOKENS.inc(seq.num_prompt_tokens)
        CACHED_TOKENS.inc(seq.num_cached_tokens or 0)
        self._prompt += seq.num_prompt_tokens
        self._cached += seq.num_cached_tokens or 0
        PREFIX_HIT_RATE.set(self._cached / self._prompt if self._prompt else 0.0)
