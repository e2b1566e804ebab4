"""tokenserve.engine.v1.EngineService: protobuf <-> domain, nothing else.

Generate validates before any compute, refuses when the waiting queue is full
(RESOURCE_EXHAUSTED with retry-after) and streams one message per step that produced
tokens. Leaving the stream (client cancel, deadline) aborts the request on the step thread,
which frees its KV blocks before the next step; a request the engine ends at its deadline
(between two steps, before gRPC's own timer fires) still ends DEADLINE_EXCEEDED.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from services.engine.engine_core import RequestOutput
from services.engine.engine_loop import AsyncEngine
from services.engine.interface import SamplingParams
from services.engine.load import LATENCY_WINDOW_S, RATE_WINDOW_S, LoadPublisher, LoadSample
from services.engine.sequence import FinishReason, Sequence, StopCriteria
from services.engine.validation import ModelLimits, validate_request
from tokenserve import sampling
from tokenserve.common.v1 import common_pb2
from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tokenserve.runtime.errors import DeadlineExceeded, ResourceExhausted, Unavailable

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name

_FINISH = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}


@dataclass(frozen=True)
class ModelInfo:
    """What GetInfo reports about the loaded model (found at start-up)."""

    model: str
    version: str
    max_context: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    device: str
    dtype: str
    block_size: int
    num_blocks: int
    max_concurrency: int
    max_waiting: int


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.info: ModelInfo | None = None  # set by main once the model is loaded
        self.load: LoadPublisher | None = None  # set by main with the info
        # Set as the server drains (SIGTERM): running streams go on, new ones are refused.
        self.draining = False

    def drain(self) -> None:
        self.draining = True

    async def Generate(self, request: engine_pb2.GenerateRequest, context):
        info = self._ready()
        if self.draining:
            raise Unavailable("this engine is draining (shutting down); retry on another replica")
        sampling = sampling_from_pb(request)
        prompt = list(request.prompt_token_ids)
        validate_request(prompt, sampling, request.max_tokens, list(request.stop),
                         list(request.stop_token_ids), ModelLimits(info.max_context, info.vocab_size))
        # running slots + the waiting queue bound every request in flight
        in_flight = self.engine.num_in_flight
        if in_flight >= info.max_concurrency + info.max_waiting:
            raise ResourceExhausted(
                f"the engine is full: {info.max_concurrency} requests running and"
                f" {info.max_waiting} waiting (the waiting limit); retry later",
                retry_after=1.0 + info.max_waiting / info.max_concurrency, limit="capacity")
        now = time.monotonic()
        remaining = context.time_remaining()
        seq = Sequence(
            seq_id=self.engine.next_seq_id(), request_id=request.request_id or uuid.uuid4().hex,
            prompt_token_ids=prompt, sampling=sampling,
            stop=StopCriteria(max_tokens=request.max_tokens,
                              stop_token_ids=frozenset(request.stop_token_ids),
                              ignore_eos=request.ignore_eos, stop=tuple(request.stop)),
            priority=request.priority, tenant_id=request.tenant_id, arrival=now,
            speculation=request.speculation if request.HasField("speculation") else True,
            deadline=now + remaining if remaining is not None else None)
        sent = 0
        async for out in self.engine.generate(seq):
            sent += len(out.token_ids)
            yield response_to_pb(out)
            if out.finish_reason is FinishReason.ERROR:
                raise Unavailable("the engine failed while running this request; retry it")
            if out.finish_reason is FinishReason.CANCELLED and _passed(seq.deadline):
                # the engine ended it at its deadline before gRPC's own timer did: the caller
                # gets the status gRPC would have sent, not an OK that reads as finished
                raise DeadlineExceeded(
                    f"the deadline passed after {sent} of"
                    f" {request.max_tokens} tokens; allow more time or ask for fewer tokens")

    async def GetInfo(self, request, context) -> engine_pb2.GetInfoResponse:
        info = self._ready()
        stats = self.engine.loop.stats
        return engine_pb2.GetInfoResponse(
            model=info.model, version=info.version, max_context=info.max_context,
            vocab_size=info.vocab_size, device=info.device, dtype=info.dtype,
            kv_block_size=info.block_size, kv_blocks_total=info.num_blocks,
            kv_blocks_free=stats.blocks_free, running=stats.running,
            waiting=self.engine.num_waiting, max_concurrency=info.max_concurrency)

    async def WatchLoad(self, request, context):
        info = self._ready()
        if self.load is None:
            raise Unavailable("this engine publishes no load reports yet; retry")
        async for sample in self.load.watch():
            yield load_to_pb(info, sample)

    def _ready(self) -> ModelInfo:
        if self.info is None or not self.engine.is_ready:
            raise Unavailable("the model is still loading; retry when health reports SERVING")
        return self.info


def _passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def sampling_from_pb(request: engine_pb2.GenerateRequest) -> SamplingParams:
    """Unset optional fields take the defaults (greedy, no penalties)."""
    return SamplingParams(**sampling.set_fields(request.sampling),
                          logprobs=request.logprobs or request.top_logprobs > 0,
                          top_logprobs=request.top_logprobs)


def response_to_pb(out: RequestOutput) -> engine_pb2.GenerateResponse:
    msg = engine_pb2.GenerateResponse(token_ids=out.token_ids, text=out.text)
    for lp in out.logprobs:
        msg.logprobs.add(token_id=lp.token_id, logprob=lp.logprob or 0.0,
                         top=[common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob)
                              for t in lp.top])
    if out.finish_reason is not None:
        msg.finish_reason = _FINISH[out.finish_reason]
    if out.final is not None:
        f = out.final
        msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=f.prompt_tokens,
                                            completion_tokens=f.completion_tokens,
                                            cached_tokens=f.cached_tokens))
        msg.timings.CopyFrom(common_pb2.Timings(
            queue_seconds=f.queue_seconds, time_to_first_token_seconds=f.time_to_first_token_seconds,
            total_seconds=f.total_seconds))
        msg.energy_joules = f.energy_joules
        msg.energy_estimated = f.energy_estimated
    return msg


def load_to_pb(info: ModelInfo, s: LoadSample) -> engine_pb2.LoadReport:
    return engine_pb2.LoadReport(
        model=info.model, version=info.version, waiting=s.waiting, running=s.running,
        kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total,
        ttft_p50_seconds=s.ttft_p50_s, ttft_p99_seconds=s.ttft_p99_s,
        itl_p50_seconds=s.itl_p50_s, itl_p99_seconds=s.itl_p99_s,
        tokens_per_second=s.tokens_per_s, watts=s.watts, watts_estimated=s.watts_estimated,
        latency_window_seconds=LATENCY_WINDOW_S, rate_window_seconds=RATE_WINDOW_S,
        max_concurrency=info.max_concurrency)
