"""The engine core: one step = schedule -> runner.execute -> update, then text and stops.

`EngineCore` is synchronous and single-threaded (the step thread owns it). It turns each
step's sampled tokens into `RequestOutput`s: detokenized text (UTF-8 safe, stop strings
held back and cut), logprobs, and on the last one usage, timings and energy.

A step comes in parts, so the step loop can overlap host work with the device's (`overlap`,
on where the runner is asynchronous: CUDA): `launch` schedules a step and submits it,
`complete` waits for its tokens and updates the sequences, `take_outputs` turns the updated
sequences' tokens into outputs. Overlapped, the loop launches step n, then takes step n-1's
outputs, delivers them and takes in new requests and cancels while the device computes,
then completes step n. A stop string found then, or a cancel, ends a sequence that step n
already computes: its token from that step is dropped at `complete` (never streamed or
billed), like any token after a stop string. `step()` is the parts in a row.
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


class PendingStep(Protocol):
    def result(self) -> RunnerOutput: ...


class Runner(Protocol):
    # whether `submit` returns before the step is computed (so overlapping pays)
    asynchronous: bool

    def execute(self, batch: Batch) -> RunnerOutput: ...

    def submit(self, batch: Batch,
               between_layers: Callable[[int, int], None] | None = None) -> PendingStep: ...


class Interjections(Protocol):
    """The step loop's side of interjected steps (EngineCore.interjections)."""

    def take_new(self) -> bool:
        """Adds requests that arrived (EngineCore.add); whether there were any."""

    def deliver_now(self, outputs: list["RequestOutput"]) -> None:
        """Sends outputs to their streams before the step in progress ends."""


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


@dataclass
class _Launched:
    """A step submitted to the runner and not yet completed."""

    batch: Batch
    pending: PendingStep
    started: float
    joules: float


class EngineCore:
    def __init__(self, runner: Runner, scheduler: Scheduler, *,
                 text_stream: Callable[[Sequence], TextStream] | None = None,
                 energy: EnergySource | None = None, observer: StepObserver | None = None,
                 clock: Callable[[], float] = time.monotonic, overlap: bool = False):
        self.runner = runner
        # the step loop overlaps host work with the device's (see the module doc)
        self.overlap = overlap
        self._events: list[TokenEvent] = []  # completed, not yet taken as outputs
        self._outputs: list[RequestOutput] = []  # made by launch/complete (failed steps)
        # Set by the step loop (plain order): a newcomer that arrives during a step on the
        # CPU gets its prompt computed between two of the step's layers (`_between_layers`).
        self.interjections: Interjections | None = None
        self._interjected_s = self._interjected_j = 0.0  # spent inside the step in progress
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

    def has_outputs(self) -> bool:
        """Outputs wait for `take_outputs` (the last step's tokens, overlapped)."""
        return bool(self._events or self._outputs)

    def abort(self, seq_id: int, reason: FinishReason = FinishReason.CANCELLED) -> RequestOutput | None:
        """Ends a request now (cancel, deadline); its blocks are free before the next step."""
        seq = self.scheduler.get(seq_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, reason, self.clock())
        # tokens it gained in a step whose outputs are not taken yet go out with its end
        event = next((ev for ev in self._events if ev.seq is seq), None)
        if event is not None:
            self._events.remove(event)
        out = (self._emit(event) if event is not None else None) or self._final(
            seq, RequestOutput(seq.seq_id, seq.request_id))
        if self.observer:
            self.observer.gauges(self.scheduler)
        return out

    def abort_all(self, reason: FinishReason) -> list[RequestOutput]:
        s = self.scheduler
        return [o for q in (*s.running, *s.waiting) if (o := self.abort(q.seq_id, reason))]

    def step(self) -> list[RequestOutput]:
        """One whole step: expired requests end, then launch, complete and take outputs."""
        outputs = self.expire()
        launched = self.launch()
        if launched is not None:
            self.complete(launched)
        return outputs + self.take_outputs()

    def expire(self) -> list[RequestOutput]:
        """Ends requests past their deadline."""
        return [o for s in self._expired(self.clock()) if (o := self.abort(s.seq_id)) is not None]

    def launch(self) -> _Launched | None:
        """Schedules a step and submits it to the runner (None: nothing to compute, or the
        runner refused the step: its requests then end with ERROR, see take_outputs)."""
        now = self.clock()
        batch = self.scheduler.schedule(now)
        if not batch.chunks:
            return None
        joules = self.energy.read_joules() if self.energy else 0.0
        self._interjected_s = self._interjected_j = 0.0
        hook = self._between_layers if self.interjections is not None else None
        try:
            return _Launched(batch, self.runner.submit(batch, hook), now, joules)
        except Exception as e:  # noqa: BLE001 - one bad step must not kill the engine
            self._failed(batch, e)
            return None

    def complete(self, launched: _Launched) -> None:
        """Waits for a launched step's tokens and applies them to the sequences; requests
        that ended since it was launched are left as they are."""
        batch = launched.batch
        try:
            result = launched.pending.result()
        except Exception as e:  # noqa: BLE001 - one bad step must not kill the engine
            self._failed(batch, e)
            return
        end = self.clock()
        events = self.scheduler.update(batch, result, end)
        if self.energy:
            self._attribute_energy(events, self.energy.read_joules() - launched.joules
                                   - self._interjected_j)
        if self.observer:
            self.observer.on_step(self, events, end - launched.started - self._interjected_s)
        self._events.extend(events)

    def _between_layers(self, done: int, total: int) -> None:
        """Called by the runner between two layers of the step in progress: requests that
        arrived meanwhile come in, and a newcomer's prompt (scheduler's
        `schedule_interjection`) is computed now, in a step of its own, and its first token
        streamed before this step ends."""
        if not self.interjections.take_new():
            return
        batch = self.scheduler.schedule_interjection(self.clock())
        if not batch.chunks:
            return
        start = self.clock()
        j0 = self.energy.read_joules() if self.energy else 0.0
        try:
            result = self.runner.execute(batch)
        except Exception as e:  # noqa: BLE001 - its requests end; the step in progress goes on
            self._failed(batch, e)
            return
        end = self.clock()
        events = self.scheduler.update(batch, result, end)
        joules = self.energy.read_joules() - j0 if self.energy else 0.0
        self._attribute_energy(events, joules)
        if self.observer:
            self.observer.on_step(self, events, end - start)
        self._interjected_s += end - start
        self._interjected_j += joules
        outputs = [o for ev in events if (o := self._emit(ev)) is not None]
        if outputs:
            self.interjections.deliver_now(outputs)

    def take_outputs(self) -> list[RequestOutput]:
        """The completed steps' tokens as outputs (text, stop strings, final stats)."""
        outputs, self._outputs = self._outputs, []
        events, self._events = self._events, []
        for ev in events:
            out = self._emit(ev)
            if out is not None:
                outputs.append(out)
        return outputs

    def _failed(self, batch: Batch, e: Exception) -> None:
        # Its requests end with ERROR rather than retrying the same failure forever.
        log.error("step_failed", exc_type=type(e).__name__, error=str(e)[:200],
                  seqs=len(batch.chunks), tokens=batch.num_tokens)
        for c in batch.chunks:
            if (o := self.abort(c.seq_id, FinishReason.ERROR)) is not None:
                self._outputs.append(o)

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
