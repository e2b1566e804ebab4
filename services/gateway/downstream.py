"""Calls to the services behind the gateway: tokenizer, engines, meter.

One channel per engine endpoint, kept for the life of the gateway (a channel is cheap when
idle, and closing one under a request still streaming from it would cut that request).
"""
from __future__ import annotations

from typing import Sequence

import grpc

from services.gateway.spool import UsageRecord
from services.gateway.validation import InferenceRequest
from tokenserve.common.v1 import common_pb2
from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc
from tokenserve.runtime.channels import aio_channel
from tokenserve.runtime.errors import from_rpc_error
from tokenserve.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc


class Channels:
    def __init__(self):
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, endpoint: str) -> grpc.aio.Channel:
        ch = self._channels.get(endpoint)
        if ch is None:
            ch = self._channels[endpoint] = aio_channel(endpoint)
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


def engine_request(req: InferenceRequest, prompt_ids: Sequence[int], *, priority: int,
                   tenant_id: str) -> engine_pb2.GenerateRequest:
    s = req.sampling
    sampling = common_pb2.SamplingParams(**{
        name: getattr(s, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed") if getattr(s, name) is not None})
    return engine_pb2.GenerateRequest(
        request_id=req.request_id, prompt_token_ids=list(prompt_ids), sampling=sampling,
        max_tokens=req.max_tokens, stop=list(req.stop), logprobs=req.logprobs,
        top_logprobs=req.top_logprobs, priority=priority, tenant_id=tenant_id,
        speculation=req.speculation)


def engine_stub(channel: grpc.aio.Channel) -> engine_pb2_grpc.EngineServiceStub:
    return engine_pb2_grpc.EngineServiceStub(channel)


class MeterClient:
    def __init__(self, channel: grpc.aio.Channel, timeout: float = 10.0):
        self._stub = meter_pb2_grpc.MeterServiceStub(channel)
        self._timeout = timeout

    async def record(self, records: list[UsageRecord]) -> None:
        events = [meter_pb2.UsageEvent(
            event_id=r.event_id, request_id=r.request_id, source=meter_pb2.SOURCE_GATEWAY,
            tenant_id=r.tenant_id, app=r.app, model=r.model, model_version=r.model_version,
            tier=r.tier, prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens,
            cached_tokens=r.cached_tokens, status=r.status, started_at=r.started_at,
            finished_at=r.finished_at, energy_joules=r.energy_joules,
            energy_estimated=r.energy_estimated) for r in records]
        await self._stub.RecordUsage(meter_pb2.RecordUsageRequest(events=events),
                                     timeout=self._timeout)
