"""The engine's own usage record of every request it ran (the meter reconciles it against
the gateway's). Written to the engine's spool when the request's final output reaches the
event loop, before its last message is streamed; the shared sender ships it to the meter.

A request without a tenant (a direct engine call, not through a gateway) is not billed and
gets no record: the meter refuses records without one.
"""
from __future__ import annotations

import time
import uuid
from typing import Callable

from prometheus_client import Counter, Gauge

from services.engine.engine_core import RequestOutput
from services.engine.sequence import FinishReason, Sequence
from tokenserve.runtime.logging import get_logger
from tokenserve.spool import SpoolSender, UsageSpool
from tokenserve.usage import Source, UsageRecord

log = get_logger(component="engine.usage")

SPOOLED = Gauge("tokenserve_engine_usage_spool_events",
                "Usage records waiting in the engine's spool for the meter")
SENT = Counter("tokenserve_engine_usage_events_sent_total", "Usage records the meter acknowledged")
UNATTRIBUTED = Counter("tokenserve_engine_usage_unattributed_total",
                       "Requests that ended without a tenant id (no usage record)")

# gRPC status name the request's stream ends with, by finish reason.
_STATUS = {FinishReason.CANCELLED: "CANCELLED", FinishReason.ERROR: "UNAVAILABLE"}


class EngineUsage:
    def __init__(self, model: str, version: str, spool: UsageSpool,
                 sender: SpoolSender | None = None, clock: Callable[[], float] = time.time):
        self.model, self.version = model, version
        self.spool, self.sender = spool, sender
        self._clock = clock
        SPOOLED.set(len(spool))

    def record(self, seq: Sequence, out: RequestOutput) -> UsageRecord | None:
        """Called on the event loop with a request's final output (cancelled ones too)."""
        f, reason = out.final, out.finish_reason
        if f is None or reason is None:
            return None
        if not seq.tenant_id:
            UNATTRIBUTED.inc()
            return None
        finished = self._clock()
        rec = UsageRecord(
            event_id=uuid.uuid4().hex, request_id=seq.request_id, source=Source.ENGINE,
            tenant_id=seq.tenant_id, model=self.model, model_version=self.version,
            prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens,
            cached_tokens=min(f.cached_tokens, f.prompt_tokens),
            status=_STATUS.get(reason, "OK"), finish_reason=reason.value,
            preempted=f.num_preemptions > 0, cancelled=reason is FinishReason.CANCELLED,
            started_at=max(0.0, finished - f.total_seconds), finished_at=finished,
            energy_joules=f.energy_joules, energy_estimated=f.energy_estimated)
        self.spool.append(rec)
        SPOOLED.inc()
        if self.sender is not None:
            self.sender.notify()
        return rec


def on_sent(n: int) -> None:
    SENT.inc(n)
    SPOOLED.dec(n)
