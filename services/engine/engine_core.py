"""The engine core: one step = schedule -> runner.execute -> update, then text and stops.

`EngineCore` is synchronous and single-threaded (the step thread owns it). It turns each
step's sampled tokens into `RequestOutput`s: detokenized text (UTF-8 safe, stop strings
held back and cut), logprobs, and on the last one usage, timings and energy.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.interface import Batch, RunnerOutput, SampledToken
from services.engine.scheduler import Scheduler, TokenEvent
from services.engine.sequence import FinishReason, Sequence
from services.engine.stop import StopMatcher
from tokenserve.runtime.logging import get_logger

log = get_logger(component="engine_core")


class Runner(Protocol):
    def execute(self, batch: Batch) -> RunnerOutput: ...


class TextStream(Protocol):
    """Per-request incremental detokenizer + stop-string matcher."""

    def push(self, token_id: int) -> tuple[str, bool]:
        """Adds a token; returns (text safe to emit now, whether a stop string matched)."""

    def flush(self) -> str:
        """Text held back (a possible stop-string prefix) once generation ends otherwise."""


class DetokenizingStream:
    """TextStream over the model tokenizer: incremental detokenizer, then stop strings."""

    # Prompt tokens decoded (never emitted) as context for the first output token.
    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer, seq: Sequence):
        self._detok = IncrementalDetokenizer(
            tokenizer, context_ids=seq.prompt_token_ids[-self.CONTEXT_TOKENS:])
        self._stop = StopMatcher(seq.stop.stop)

    def push(self, token_id: int) -> tuple[str, bool]:
        return self._stop.push(self._detok.push(token_id))

    def flush(self) -> str:
        text, stopped = self._stop.push(self._detok.flush())
        return text if stopped else text + self._stop.flush()


def text_stream_factory(tokenizer) -> Callable[[Sequence], TextStream]:
    return lambda seq: DetokenizingStream(tokenizer, seq)


class EnergySource(Protocol):
    estimated: bool

    def read_joules(self) -> float: ...


@dataclass(frozen=True)
class FinalStats:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_seconds: float
    time_to_first_token_seconds: float
    total_seconds: float
    energy_joules: float
    energy_estimated: bool
    num_preemptions: int


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    seq_id: int
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    final: FinalStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepObserver(Protocol):
    """Metrics hook, called on the step thread."""

    def on_step(self, core: "EngineCore", events: list[TokenEvent], seconds: float) -> None: ...

    def on_finish(self, seq: Sequence) -> None: ...

    def gauges(self, scheduler: Scheduler) -> None: ...


class EngineCore:
    def __init__(self, runner: Runner, scheduler: Scheduler, *,
                 text_stream: Callable[[Sequence], TextStream] | None = None,
                 energy: EnergySource | None = None, observer: StepObserver | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.runner = runner
        self.scheduler = scheduler
        self._text_stream = text_stream
        self._texts: dict[int, TextStream] = {}
        self.energy = energy
        self.observer = observer
        self.clock = clock

    def add(self, seq: Sequence) -> None:
        if self._text_stream is not None:
            self._texts[seq.seq_id] = self._text_stream(seq)
        self.scheduler.add(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, seq_id: int, reason: FinishReason = FinishReason.CANCELLED) -> RequestOutput | None:
        """Ends a request now (cancel, deadline); its blocks are free before the next step."""
        seq = self.scheduler.get(seq_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, reason, self.clock())
        out = self._final(seq, RequestOutput(seq.seq_id, seq.request_id))
        if self.observer:
            self.observer.gauges(self.scheduler)
        return out

    def abort_all(self, reason: FinishReason) -> list[RequestOutput]:
        s = self.scheduler
        return [o for q in (*s.running, *s.waiting) if (o := self.abort(q.seq_id, reason))]

    def step(self) -> list[RequestOutput]:
        now = self.clock()
        outputs = [o for s in self._expired(now)
                   if (o := self.abort(s.seq_id)) is not None]
        batch = self.scheduler.schedule(now)
        if not batch.chunks:
            return outputs
        j0 = self.energy.read_joules() if self.energy else 0.0
        try:
            result = self.runner.execute(batch)
        except Exception as e:  # noqa: BLE001 - one bad step must not kill the engine
            # Its requests end with ERROR rather than retrying the same failure forever.
            log.error("step_failed", exc_type=type(e).__name__, error=str(e)[:200],
                      seqs=len(batch.chunks), tokens=batch.num_tokens)
            for c in batch.chunks:
                if (o := self.abort(c.seq_id, FinishReason.ERROR)) is not None:
                    outputs.append(o)
            return outputs
        end = self.clock()
        events = self.scheduler.update(batch, result, end)
        if self.energy:
            self._attribute_energy(events, self.energy.read_joules() - j0)
        if self.observer:
            self.observer.on_step(self, events, end - now)
        for ev in events:
            out = self._emit(ev)
            if out is not None:
                outputs.append(out)
        return outputs

    def _expired(self, now: float) -> list[Sequence]:
        s = self.scheduler
        return [q for q in (*s.running, *s.waiting) if q.deadline is not None and q.deadline <= now]

    def _attribute_energy(self, events: list[TokenEvent], joules: float) -> None:
        tokens = sum(ev.num_computed for ev in events)
        if tokens <= 0 or joules <= 0:
            return
        for ev in events:
            ev.seq.energy_joules += joules * ev.num_computed / tokens

    def _emit(self, ev: TokenEvent) -> RequestOutput | None:
        seq = ev.seq
        if not ev.tokens:
            return None
        out = RequestOutput(seq.seq_id, seq.request_id)
        text = self._texts.get(seq.seq_id)
        for i, tok in enumerate(ev.tokens):
            out.token_ids.append(tok.token_id)
            if seq.sampling.logprobs:
                out.logprobs.append(tok)
            if text is None:
                continue
            delta, stopped = text.push(tok.token_id)
            out.text += delta
            if stopped:
                # tokens accepted after the stop string are dropped: never streamed nor billed
                if dropped := len(ev.tokens) - 1 - i:
                    del seq.output_token_ids[-dropped:]
                if seq.finished:
                    seq.finish_reason = FinishReason.STOP
                else:
                    self.scheduler.finish(seq, FinishReason.STOP, self.clock())
                break
        else:
            if text is not None and seq.finished:
                out.text += text.flush()
        if seq.finished:
            return self._final(seq, out)
        return out

    def _final(self, seq: Sequence, out: RequestOutput) -> RequestOutput:
        self._texts.pop(seq.seq_id, None)
        out.finish_reason = seq.finish_reason
        end = seq.finished_at if seq.finished_at is not None else self.clock()
        first_token = seq.first_token_at if seq.first_token_at is not None else end
        first_sched = seq.first_scheduled_at if seq.first_scheduled_at is not None else end
        out.final = FinalStats(
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=len(seq.output_token_ids),
            cached_tokens=seq.num_cached_tokens or 0,
            queue_seconds=max(0.0, first_sched - seq.arrival),
            time_to_first_token_seconds=max(0.0, first_token - seq.arrival),
            total_seconds=max(0.0, end - seq.arrival),
            energy_joules=seq.energy_joules,
            energy_estimated=bool(self.energy and self.energy.estimated),
            num_preemptions=seq.num_preemptions)
        if self.observer:
            self.observer.on_finish(seq)
        return out
