"""InferenceService adapter: protobuf <-> the pipeline's plain types, plus per-call metrics."""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

from services.gateway import metrics
from services.gateway.auth import Caller, authenticate
from services.gateway.downstream import FINISH_TO_PB, MeterClient, TokenLogprob
from services.gateway.inference import Chunk, Pipeline
from services.gateway.usage import tenant_usage_query
from services.gateway.validation import (SESSION_HEADER, InferenceRequest, Message,
                                         check_messages, check_prompt, validate)
from tokenserve import sampling
from tokenserve.common.v1 import common_pb2
from tokenserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tokenserve.runtime import wire
from tokenserve.runtime.errors import ServiceError, Unavailable
from tokenserve.sampling import SamplingParams

# Controls the public requests also take at the top level (the common ones, as in OpenAI's
# API): the sampling fields GenerateRequest has as its own.
_TOP_LEVEL_SAMPLING = tuple(f for f in sampling.FIELDS
                            if f in gateway_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)


def _sampling(request) -> SamplingParams:
    """Top-level temperature/top_p/top_k/seed, overridden by fields set in `sampling`."""
    values = {name: getattr(request, name) for name in _TOP_LEVEL_SAMPLING
              if request.HasField(name)}
    values.update(sampling.set_fields(request.sampling))
    return SamplingParams(**values)


def _messages(pb_messages) -> tuple[Message, ...]:
    return tuple(Message(role=m.role, content=m.content) for m in pb_messages)


def request_from_pb(request, *, chat: bool, session_id: str = "") -> InferenceRequest:
    return InferenceRequest(
        model=request.model, max_tokens=request.max_tokens,
        prompt=None if chat else request.prompt,
        messages=_messages(request.messages) if chat else None,
        sampling=_sampling(request), stop=tuple(request.stop), request_id=request.request_id,
        app=request.app, logprobs=request.logprobs, top_logprobs=request.top_logprobs,
        speculation=request.speculation if request.HasField("speculation") else None,
        session_id=session_id)


def _logprob_pb(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=[
        common_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp.top])


def chunk_to_pb(chunk: Chunk, *, first: bool) -> gateway_pb2.GenerateResponse:
    last = chunk.finish_reason is not None
    resp = gateway_pb2.GenerateResponse(text=chunk.text, token_ids=chunk.token_ids,
                                        logprobs=[_logprob_pb(lp) for lp in chunk.logprobs],
                                        request_id=chunk.request_id if first or last else "")
    if last:
        resp.finish_reason = FINISH_TO_PB[chunk.finish_reason]
        resp.usage.CopyFrom(common_pb2.Usage(prompt_tokens=chunk.prompt_tokens,
                                             completion_tokens=chunk.completion_tokens,
                                             cached_tokens=chunk.cached_tokens))
        resp.model_version = chunk.model_version
    return resp


def add_to_server(servicer: "InferenceServicer", server) -> None:
    """The generated `add_InferenceServiceServicer_to_server`, but invalid UTF-8 in a request
    is INVALID_ARGUMENT naming the field (tokenserve.runtime.wire), not UNKNOWN."""
    wire.add_servicer(servicer, server, gateway_pb2, "InferenceService")


class InferenceServicer(gateway_pb2_grpc.InferenceServiceServicer):
    def __init__(self, pipeline: Pipeline, default_timeout: float,
                 meter: MeterClient | None = None):
        self._pipeline = pipeline
        self._default_timeout = default_timeout
        self._meter = meter

    def _timeout(self, context) -> float:
        remaining = context.time_remaining()
        return self._default_timeout if remaining is None else remaining

    def _caller(self, context) -> Caller:
        return authenticate(self._pipeline.snapshot, context.invocation_metadata())

    async def _stream(self, method: str, request, context, *, chat: bool):
        started, tier, code = time.monotonic(), "none", "OK"
        headers: asyncio.Future | None = None
        try:
            caller = self._caller(context)
            tier = caller.tier
            request = wire.parsed(request)
            session = dict(context.invocation_metadata() or ()).get(SESSION_HEADER, "")
            req = validate(request_from_pb(request, chat=chat, session_id=session),
                           tier_cap=caller.max_tokens, tier=caller.tier)
            first = True

            def on_admitted(metadata):
                # sent while the engine works; awaited before the first message
                nonlocal headers
                headers = asyncio.ensure_future(context.send_initial_metadata(metadata))

            async with aclosing(self._pipeline.stream(caller, req, self._timeout(context),
                                                      on_admitted=on_admitted)) as s:
                async for chunk in s:
                    if headers is not None:
                        sending, headers = headers, None
                        await sending
                    yield chunk_to_pb(chunk, first=first)
                    first = False
        except ServiceError as e:
            code = e.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            code = "CANCELLED"
            raise
        finally:
            if headers is not None:
                # ended before any message: the status must not go out while the headers
                # are still being sent (gRPC would refuse a second set of headers)
                await asyncio.gather(headers, return_exceptions=True)
            metrics.REQUESTS.labels(method, tier, code).inc()
            metrics.REQUEST_SECONDS.labels(method).observe(time.monotonic() - started)

    async def Generate(self, request, context):
        async with aclosing(self._stream("Generate", request, context, chat=False)) as s:
            async for resp in s:
                yield resp

    async def Chat(self, request, context):
        async with aclosing(self._stream("Chat", request, context, chat=True)) as s:
            async for resp in s:
                yield resp

    async def _unary(self, method: str, request, context, fn):
        tier, code = "none", "OK"
        try:
            caller = self._caller(context)
            tier = caller.tier
            return await fn(wire.parsed(request))
        except ServiceError as e:
            code = e.code.name
            raise
        finally:
            metrics.REQUESTS.labels(method, tier, code).inc()

    async def CountTokens(self, request, context):
        async def count(request):
            which = request.WhichOneof("input")
            if which == "chat":
                messages = _messages(request.chat.messages)
                check_messages(messages)
                req = InferenceRequest(model=request.model, max_tokens=1, messages=messages)
            else:
                check_prompt(request.prompt)
                req = InferenceRequest(model=request.model, max_tokens=1, prompt=request.prompt)
            n = await self._pipeline.count_tokens(req, self._timeout(context))
            return gateway_pb2.CountTokensResponse(count=n)

        return await self._unary("CountTokens", request, context, count)

    async def ListModels(self, request, context):
        async def models(_request):
            infos = self._pipeline.router.models(self._pipeline.snapshot)
            return gateway_pb2.ListModelsResponse(models=[
                gateway_pb2.Model(name=m.name, max_context=m.max_context, versions=[
                    gateway_pb2.ModelVersion(version=v, weight=w) for v, w in m.versions])
                for m in infos])

        return await self._unary("ListModels", request, context, models)

    async def GetUsage(self, request, context):
        async def usage(request):
            if self._meter is None:
                raise Unavailable("this gateway has no meter to read usage from")
            query = tenant_usage_query(self._caller(context), request)
            resp = await self._meter.query(query, self._timeout(context))
            return gateway_pb2.GetUsageResponse(rows=resp.rows)

        return await self._unary("GetUsage", request, context, usage)
