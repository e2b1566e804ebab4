"""Calls to the services behind the gateway: tokenizer, engines, meter. Protobuf and grpc
stop here: the pipeline sees only the plain types below and ServiceErrors.

One channel per engine endpoint, kept for the life of the gateway (a channel is cheap when
idle, and closing one under a request still streaming from it would cut that request).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.load import EngineLoad
from services.gateway.validation import InferenceRequest
from tokenserve import sampling
from tokenserve.common.v1 import common_pb2
from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc
from tokenserve.runtime.channels import aio_channel
from tokenserve.runtime.errors import ServiceError, from_rpc_error
from tokenserve.runtime.tls import PLAINTEXT, TlsConfig
from tokenserve.spool import send_usage
from tokenserve.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tokenserve.usage import UsageRecord


class Channels:
    """One channel per engine endpoint, TLS when `tls` has a CA."""

    def __init__(self, tls: TlsConfig = PLAINTEXT):
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, endpoint: str) -> grpc.aio.Channel:
        ch = self._channels.get(endpoint)
        if ch is None:
            ch = self._channels[endpoint] = aio_channel(endpoint, tls=self._tls)
        return ch

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            await ch.close()


class TokenizerClient:
    def __init__(self, channel: grpc.aio.Channel):
        self._stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)

    @staticmethod
    def _request(model: str, req: InferenceRequest) -> tokenizer_pb2.EncodeRequest:
        if req.messages is not None:
            chat = tokenizer_pb2.ChatMessages(messages=[
                common_pb2.ChatMessage(role=m.role, content=m.content) for m in req.messages])
            # The chat template writes its own special tokens; the assistant turn is opened.
            return tokenizer_pb2.EncodeRequest(model=model, chat=chat, add_generation_prompt=True)
        return tokenizer_pb2.EncodeRequest(model=model, text=req.prompt, add_special_tokens=True)

    async def encode(self, model: str, req: InferenceRequest, timeout: float) -> list[int]:
        try:
            resp = await self._stub.Encode(self._request(model, req), timeout=timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, context="tokenizer") from None
        return list(resp.token_ids)

    async def count(self, model: str, req: InferenceRequest, timeout: float) -> int:
        try:
            resp = await self._stub.CountTokens(self._request(model, req), timeout=timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, context="tokenizer") from None
        return resp.count

    async def token_texts(self, model: str, token_ids: Sequence[int],
                          timeout: float) -> dict[int, str]:
        """Each id's own text (for logprobs), special tokens included."""
        req = tokenizer_pb2.DecodeBatchRequest(model=model, requests=[
            tokenizer_pb2.DecodeRequest(model=model, token_ids=[i]) for i in token_ids])
        try:
            resp = await self._stub.DecodeBatch(req, timeout=timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, context="tokenizer") from None
        return {i: r.text for i, r in zip(token_ids, resp.results)}


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


_FINISH_FROM_PB = {common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
                   common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
                   common_pb2.FINISH_REASON_CANCELLED: FinishReason.CANCELLED,
                   common_pb2.FINISH_REASON_ERROR: FinishReason.ERROR}
FINISH_TO_PB = {v: k for k, v in _FINISH_FROM_PB.items()}


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # (token id, logprob) of the top alternatives, most likely first.
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class EngineChunk:
    """One engine message; the last one has `finish_reason` and the engine's accounting."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    energy_joules: float = 0.0
    energy_estimated: bool = False
    # The engine's own time to first token (from its arrival); 0 when it reports none.
    engine_ttft_s: float = 0.0


class EngineRefused(Exception):
    """The engine answered before doing any work for the request: nothing to bill.
    `retryable`: another replica may take it (unreachable or full)."""

    def __init__(self, error: ServiceError, *, retryable: bool):
        super().__init__(error.message)
        self.error = error
        self.retryable = retryable


class EngineFailed(Exception):
    """The engine call failed after the engine took it. `error` is what the caller gets;
    `code` the engine's own status name (INTERNAL reaches the caller as UNAVAILABLE, but only
    a real UNAVAILABLE says the replica is unreachable or down)."""

    def __init__(self, error: ServiceError, code: str, *, before_first_token: bool):
        super().__init__(error.message)
        self.error = error
        self.code = code
        self.before_first_token = before_first_token


# Codes an engine answers with before any compute: it was not reached, was full, or refused
# the input in its validation. Before the first message they mean "no work was done".
_NO_WORK = {grpc.StatusCode.UNAVAILABLE: True, grpc.StatusCode.RESOURCE_EXHAUSTED: True,
            grpc.StatusCode.INVALID_ARGUMENT: False, grpc.StatusCode.FAILED_PRECONDITION: False}


def engine_request(req: InferenceRequest, prompt_ids: Sequence[int], *, priority: int,
                   tenant_id: str) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=req.request_id, prompt_token_ids=list(prompt_ids),
        sampling=sampling.to_pb(req.sampling),
        max_tokens=req.max_tokens, stop=list(req.stop), logprobs=req.logprobs,
        top_logprobs=req.top_logprobs, priority=priority, tenant_id=tenant_id,
        speculation=req.speculation)


def _chunk(resp: engine_pb2.GenerateResponse) -> EngineChunk:
    return EngineChunk(
        text=resp.text, token_ids=tuple(resp.token_ids),
        logprobs=tuple(TokenLogprob(lp.token_id, lp.logprob,
                                    tuple((t.token_id, t.logprob) for t in lp.top))
                       for lp in resp.logprobs),
        finish_reason=_FINISH_FROM_PB.get(resp.finish_reason),
        cached_tokens=resp.usage.cached_tokens, energy_joules=resp.energy_joules,
        energy_estimated=resp.energy_estimated,
        engine_ttft_s=resp.timings.time_to_first_token_seconds)


class EngineClient:
    """Streams a generation from one engine replica. Leaving the iteration early (caller
    cancel, deadline) cancels the call, which frees the request's KV blocks on the engine.

    Errors: `EngineRefused` when the engine did no work (before the first message);
    otherwise `EngineFailed` holding the engine's status as a ServiceError naming the
    engine."""

    def __init__(self, channels: Channels):
        self._channels = channels
        self._stubs: dict[str, tuple[grpc.aio.Channel, engine_pb2_grpc.EngineServiceStub]] = {}

    def _stub(self, endpoint: str) -> engine_pb2_grpc.EngineServiceStub:
        """The endpoint's stub, made once per channel (a stub builds a callable per method)."""
        channel = self._channels.get(endpoint)
        cached = self._stubs.get(endpoint)
        if cached is None or cached[0] is not channel:
            cached = self._stubs[endpoint] = (channel, engine_pb2_grpc.EngineServiceStub(channel))
        return cached[1]

    async def generate(self, endpoint: str, req: InferenceRequest, prompt_ids: Sequence[int],
                       *, priority: int, tenant_id: str,
                       timeout: float) -> AsyncIterator[EngineChunk]:
        request = engine_request(req, prompt_ids, priority=priority, tenant_id=tenant_id)
        call = self._stub(endpoint).Generate(request, timeout=timeout)
        first = True
        try:
            async for resp in call:
                first = False
                yield _chunk(resp)
        except grpc.RpcError as e:
            error = from_rpc_error(e, context=f"engine {endpoint}")
            code = e.code() if hasattr(e, "code") else None
            if first and code in _NO_WORK:
                raise EngineRefused(error, retryable=_NO_WORK[code]) from None
            raise EngineFailed(error, code.name if code else "UNKNOWN",
                               before_first_token=first) from None
        finally:
            call.cancel()

    async def serving(self, endpoint: str, timeout: float) -> bool:
        """grpc.health.v1 Check of the whole server: True only for SERVING."""
        stub = health_pb2_grpc.HealthStub(self._channels.get(endpoint))
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING


    async def watch_load(self, endpoint: str) -> AsyncIterator[EngineLoad]:
        """The engine's load reports (WatchLoad), each stamped with when it arrived; ends or
        raises a ServiceError when the stream does."""
        stub = engine_pb2_grpc.EngineServiceStub(self._channels.get(endpoint))
        call = stub.WatchLoad(engine_pb2.WatchLoadRequest())
        try:
            async for r in call:
                yield load_from_pb(endpoint, r, time.monotonic())
        except grpc.RpcError as e:
            raise from_rpc_error(e, context=f"engine {endpoint} load") from None
        finally:
            call.cancel()


def load_from_pb(endpoint: str, r: engine_pb2.LoadReport, received_at: float) -> EngineLoad:
    return EngineLoad(
        endpoint=endpoint, model=r.model, version=r.version, waiting=r.waiting,
        running=r.running, kv_blocks_used=r.kv_blocks_used, kv_blocks_total=r.kv_blocks_total,
        ttft_p50_s=r.ttft_p50_seconds, ttft_p99_s=r.ttft_p99_seconds,
        itl_p50_s=r.itl_p50_seconds, itl_p99_s=r.itl_p99_seconds,
        tokens_per_s=r.tokens_per_second, watts=r.watts, watts_estimated=r.watts_estimated,
        received_at=received_at)


class MeterClient:
    def __init__(self, channel: grpc.aio.Channel, timeout: float = 10.0):
        self._stub = meter_pb2_grpc.MeterServiceStub(channel)
        self._timeout = timeout

    async def record(self, records: list[UsageRecord]) -> None:
        await send_usage(self._stub, records, self._timeout)

    async def query(self, request: meter_pb2.QueryUsageRequest,
                    timeout: float) -> meter_pb2.QueryUsageResponse:
        """The meter's answer; its errors keep their status (a bad window stays
        INVALID_ARGUMENT), an unreachable meter is UNAVAILABLE."""
        try:
            return await self._stub.QueryUsage(request, timeout=min(timeout, self._timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e, context="meter") from None
