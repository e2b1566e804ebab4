"""The step thread and the asyncio client that feeds it.

All model compute runs on ONE dedicated thread (torch's OpenMP teams oversubscribe the
cores when called from a changing pool of threads). The asyncio front never blocks it:
requests and aborts go in through a thread-safe queue plus a wake-up event; each step's
outputs come back with one `loop.call_soon_threadsafe` into per-request asyncio queues.
When idle the thread sleeps on the event (no polling). Woken from idle, it lets a burst
arrive first: it starts the first step once no request has come in for GATHER_QUIET_S
(at most GATHER_MAX_S after the first), so requests sent together are scheduled together
(a lone request waits GATHER_QUIET_S). Where the runner is asynchronous (CUDA), each step
overlaps the host's work with the device's (`_overlapped_step`; engine_core's module doc).
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from services.engine.engine_core import EngineCore, RequestOutput
from services.engine.sequence import FinishReason, Sequence
from tokenserve.runtime.logging import get_logger

log = get_logger(component="engine_loop")

GATHER_QUIET_S = 0.005
# 64 streams sent at once reach the step thread over ~16 ms (each RPC's handler runs on the
# one event loop), longer on a busy machine; a burst cut short starts streaming before the
# rest arrives, and the rest is then prefilled in small chunks beside it (one such run: p99
# first token 10.6 s instead of 3 s)
GATHER_MAX_S = 0.05


@dataclass(frozen=True)
class EngineStats:
    """Published by the step thread after every step (read from any thread)."""

    running: int = 0
    waiting: int = 0
    blocks_free: int = 0
    blocks_total: int = 0


class EngineLoop:
    """Owns the step thread. `build` runs on that thread (so model loading and every torch
    call happen there); `deliver` is called on it with each step's outputs."""

    def __init__(self, build: Callable[[], EngineCore],
                 deliver: Callable[[list[RequestOutput]], None], name: str = "engine-step"):
        self._build = build
        self._deliver = deliver
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._held: list[tuple] = []  # cancels taken in during a step, applied after it
        self._wake = threading.Event()
        self._stop = False
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.core: EngineCore | None = None
        self.stats = EngineStats()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, seq: Sequence) -> None:
        self._inbox.put(("add", seq))
        self._wake.set()

    def abort(self, seq_id: int, reason: FinishReason = FinishReason.CANCELLED) -> None:
        self._inbox.put(("abort", seq_id, reason))
        self._wake.set()

    @property
    def pending(self) -> int:
        """Commands not yet taken by the step thread (a bound on unseen new requests)."""
        return self._inbox.qsize()

    def stop(self, timeout: float | None = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self.core = self._build()
        except BaseException as e:  # noqa: BLE001 - reported to whoever waits on ready
            self.error = e
            log.error("engine_build_failed", exc_type=type(e).__name__, error=str(e)[:500])
            self.ready.set()
            return
        self._publish()
        self.ready.set()
        core = self.core
        if not core.overlap:
            core.interjections = self  # newcomers between a step's layers (the CPU)
        while not self._stop:
            if not core.has_work() and not core.has_outputs() and self._inbox.empty():
                self._wake.wait()
                self._gather()
            # cleared before draining: a submit after the drain sets it again
            self._wake.clear()
            try:
                outputs = self._overlapped_step(core) if core.overlap else self._step(core)
            except Exception as e:  # noqa: BLE001 - a core bug must not hang every stream
                log.error("step_loop_error", exc_type=type(e).__name__, error=str(e)[:500])
                outputs = core.take_outputs() + core.abort_all(FinishReason.ERROR)
            self._publish()
            if outputs:
                self._deliver(outputs)
        # stopping: what is still here (streams cut at the end of the grace period, their
        # aborts not yet taken) ends as cancelled, so its usage is recorded like any cancel's
        outputs = self._drain(core) + core.abort_all(FinishReason.CANCELLED)
        self._publish()
        if outputs:
            self._deliver(outputs)

    def _step(self, core: EngineCore) -> list[RequestOutput]:
        outputs = self._drain(core)
        if core.has_work():
            outputs.extend(core.step())
        return outputs

    def _overlapped_step(self, core: EngineCore) -> list[RequestOutput]:
        """Launches step n; while the device computes it, the host emits step n-1's tokens,
        delivers them and takes in new requests and cancels; then completes step n (its
        tokens go out after step n+1 is launched)."""
        launched = core.launch() if core.has_work() else None
        outputs = core.take_outputs() + self._drain(core) + core.expire()
        if launched is None:
            return outputs
        self._publish()
        if outputs:
            self._deliver(outputs)
        core.complete(launched)
        return []

    def _gather(self) -> None:
        deadline = time.monotonic() + GATHER_MAX_S
        while not self._stop:
            self._wake.clear()
            left = deadline - time.monotonic()
            if left <= 0 or not self._wake.wait(min(GATHER_QUIET_S, left)):
                return

    def _drain(self, core: EngineCore) -> list[RequestOutput]:
        outputs = []
        held, self._held = self._held, []
        for cmd in held:
            if (out := core.abort(cmd[1], cmd[2])) is not None:
                outputs.append(out)
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if cmd[0] == "add":
                core.add(cmd[1])
            elif (out := core.abort(cmd[1], cmd[2])) is not None:
                outputs.append(out)

    # -- EngineCore.interjections: called between the layers of a step --------------------
    def take_new(self) -> bool:
        """Takes in the requests that arrived; cancels wait for the step's end (the step in
        progress still writes its sequences' blocks)."""
        added = False
        while not self._inbox.empty():  # called between every two layers: cheap when empty
            cmd = self._inbox.get()
            if cmd[0] == "add":
                self.core.add(cmd[1])
                added = True
            else:
                self._held.append(cmd)
        return added

    def deliver_now(self, outputs: list[RequestOutput]) -> None:
        self._publish()
        self._deliver(outputs)

    def _publish(self) -> None:
        s, b = self.core.scheduler, self.core.scheduler.blocks
        self.stats = EngineStats(running=s.num_running, waiting=s.num_waiting,
                                 blocks_free=b.num_free_blocks, blocks_total=b.num_blocks)


def merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """b after a, as one output."""
    return RequestOutput(a.seq_id, a.request_id, token_ids=a.token_ids + b.token_ids,
                         text=a.text + b.text, logprobs=a.logprobs + b.logprobs,
                         finish_reason=b.finish_reason, final=b.final)


class AsyncEngine:
    """The asyncio side: `generate(seq)` yields that request's outputs until it finishes;
    leaving the iteration early (cancel, deadline, error) aborts it on the step thread."""

    def __init__(self, build: Callable[[], EngineCore],
                 on_final: Callable[[Sequence, RequestOutput], None] | None = None,
                 on_change: Callable[[], None] | None = None):
        self._queues: dict[int, asyncio.Queue] = {}
        # Submitted and without a final output yet; a stream left early stays here until
        # its abort's final output arrives, so `on_final` sees cancelled requests too.
        self._unfinished: dict[int, Sequence] = {}
        # Called on the event loop with each request's final output (usage records).
        self.on_final = on_final
        # Called on the event loop when a request arrives or ends and after each step that
        # produced output (the load reports go out early on change).
        self.on_change = on_change
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self.loop = EngineLoop(build, self._deliver)

    def start(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self.loop.start()

    async def wait_ready(self) -> None:
        """Returns once the core is built (model loaded); raises what building raised."""
        await asyncio.to_thread(self.loop.ready.wait)
        if self.loop.error is not None:
            raise self.loop.error

    @property
    def is_ready(self) -> bool:
        return self.loop.ready.is_set() and self.loop.error is None

    def next_seq_id(self) -> int:
        return next(self._ids)

    @property
    def num_waiting(self) -> int:
        return self.loop.stats.waiting + self.loop.pending

    @property
    def num_in_flight(self) -> int:
        """Streams submitted and not yet finished (exact: counted on the event loop)."""
        return len(self._queues)

    async def generate(self, seq: Sequence) -> AsyncIterator[RequestOutput]:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[seq.seq_id] = q
        self._unfinished[seq.seq_id] = seq
        finished = False
        try:
            self.loop.submit(seq)
            self._changed()
            while not finished:
                out: RequestOutput = await q.get()
                # a slow reader gets what piled up as one message
                while not out.finished and not q.empty():
                    out = merge(out, q.get_nowait())
                finished = out.finished
                yield out
        finally:
            self._queues.pop(seq.seq_id, None)
            if not finished:
                self.loop.abort(seq.seq_id)
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def stop(self) -> None:
        self.loop.stop()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # step thread -> event loop, once per step
        try:
            self._aloop.call_soon_threadsafe(self._dispatch, outputs)
        except RuntimeError:  # event loop closed during shutdown: nobody is listening
            pass

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.final is not None:
                self._finished(out)
            q = self._queues.get(out.seq_id)
            if q is not None:
                q.put_nowait(out)
        self._changed()

    def _finished(self, out: RequestOutput) -> None:
        seq = self._unfinished.pop(out.seq_id, None)
        if seq is None or self.on_final is None:
            return
        try:
            self.on_final(seq, out)
        except Exception as e:  # noqa: BLE001 - a usage write must not stop other streams
            log.error("on_final_failed", exc_type=type(e).__name__, error=str(e)[:200],
                      request_id=out.request_id)
