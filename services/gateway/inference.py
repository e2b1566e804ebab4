"""One request through the pipeline: tokenize, route, stream from an engine, record usage.

    async with aclosing(pipeline.stream(caller, request, timeout)) as chunks:
        async for chunk in chunks: ...

Closing the stream early (client cancel, deadline) cancels the engine call, which frees the
request's KV blocks. The usage record is committed to the spool before the last chunk is
handed out, and also written (status CANCELLED or the error code) when the request ends
any other way after an engine call started.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

import grpc
import structlog

from controlplane.snapshot import ConfigSnapshot
from services.gateway import metrics
from services.gateway.auth import Caller
from services.gateway.downstream import (Channels, TokenizerClient, engine_request,
                                         engine_stub)
from services.gateway.routing import Router, Target
from services.gateway.validation import InferenceRequest, check_context
from tokenserve.common.v1 import common_pb2
from tokenserve.runtime.errors import (DeadlineExceeded, ServiceError, Unavailable,
                                       from_rpc_error)
from tokenserve.spool import SpoolSender, UsageSpool
from tokenserve.usage import Source, UsageRecord, finish_reason_name

# Lazy: resolved at first use, after configure_logging (JSON lines).
log = structlog.get_logger(component="inference")


# How an engine-reported finish is written in the usage record's status.
_FINISH_STATUS = {common_pb2.FINISH_REASON_CANCELLED: "CANCELLED",
                  common_pb2.FINISH_REASON_ERROR: "UNKNOWN"}
# Statuses of a request the caller (or its deadline) ended before it finished.
_CANCELLED_STATUSES = frozenset({"CANCELLED", "DEADLINE_EXCEEDED"})


class ConfigSource(Protocol):
    """The control-plane watcher, or anything else that holds the current snapshot."""

    @property
    def snapshot(self) -> ConfigSnapshot: ...


@dataclass
class Chunk:
    """One message to the caller; the last one has finish_reason and usage set."""

    text: str
    token_ids: list[int]
    request_id: str
    # Engine logprob messages, passed through unchanged (common.v1.TokenLogprob).
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    model_version: str = ""


class _Progress:
    """What the request has used so far; becomes the usage record."""

    def __init__(self, caller: Caller, req: InferenceRequest, model: str, prompt_tokens: int):
        self.caller, self.req, self.model = caller, req, model
        self.prompt_tokens = prompt_tokens
        self.version = ""
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.energy_joules = 0.0
        self.energy_estimated = False
        self.finish_reason = ""
        self.engine_called = False
        self.recorded = False
        self.started_at = time.time()

    def record(self, status: str) -> UsageRecord:
        return UsageRecord(
            event_id=uuid.uuid4().hex, request_id=self.req.request_id, source=Source.GATEWAY,
            tenant_id=self.caller.tenant_id, app=self.req.app, model=self.model,
            model_version=self.version, tier=self.caller.tier,
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            cached_tokens=min(self.cached_tokens, self.prompt_tokens), status=status,
            finish_reason=self.finish_reason,
            cancelled=status in _CANCELLED_STATUSES or self.finish_reason == "cancelled",
            started_at=self.started_at, finished_at=max(time.time(), self.started_at),
            energy_joules=self.energy_joules, energy_estimated=self.energy_estimated)


class Pipeline:
    def __init__(self, config: ConfigSource, router: Router, tokenizer: TokenizerClient,
                 channels: Channels, spool: UsageSpool, sender: SpoolSender | None, *,
                 max_engine_attempts: int = 3):
        self._config = config
        self.router = router
        self.tokenizer = tokenizer
        self._channels = channels
        self._spool = spool
        self._sender = sender
        self._max_attempts = max_engine_attempts

    @property
    def snapshot(self) -> ConfigSnapshot:
        return self._config.snapshot

    def _spool_usage(self, progress: _Progress, status: str) -> None:
        if progress.recorded:
            return
        progress.recorded = True
        self._spool.append(progress.record(status))
        metrics.USAGE_EVENTS_SPOOLED.inc()
        if self._sender is not None:
            self._sender.notify()

    async def stream(self, caller: Caller, req: InferenceRequest,
                     timeout: float) -> AsyncIterator[Chunk]:
        """`req` must be validated; `timeout` is the seconds left of the caller's deadline."""
        arrived = time.monotonic()
        deadline = arrived + timeout

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(f"deadline of {timeout:.3g}s passed")
            return remaining

        snap = self.snapshot
        model = self.router.resolve_model(snap, req.model)
        self.router.check_available(snap, model)
        prompt_ids = await self.tokenizer.encode(model, req, left())
        check_context(len(prompt_ids), req.max_tokens, self.router.max_context(snap, model))
        progress = _Progress(caller, req, model, len(prompt_ids))
        status = "UNKNOWN"
        try:
            async with aclosing(self._generate(snap, progress, prompt_ids, left, arrived)) as gen:
                async for chunk in gen:
                    yield chunk
            status = "OK"
        except ServiceError as e:
            status = e.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED"
            raise
        finally:
            if progress.engine_called:
                self._spool_usage(progress, status)

    async def _generate(self, snap: ConfigSnapshot, progress: _Progress, prompt_ids: list[int],
                        left, arrived: float) -> AsyncIterator[Chunk]:
        caller, req = progress.caller, progress.req
        request = engine_request(req, prompt_ids, priority=caller.priority,
                                 tenant_id=caller.tenant_id)
        cost = len(prompt_ids) + req.max_tokens
        failed: set[str] = set()
        for attempt in range(self._max_attempts):
            target = self.router.choose(snap, progress.model, tenant_id=caller.tenant_id,
                                        exclude=frozenset(failed))
            self.router.acquire(target.endpoint, cost)
            progress.version = target.version
            progress.engine_called = True
            call = engine_stub(self._channels.get(target.endpoint)).Generate(
                request, timeout=left())
            first = True
            try:
                async for resp in call:
                    chunk = self._chunk(progress, target, resp)
                    if first:
                        first = False
                        metrics.TIME_TO_FIRST_TOKEN.labels(caller.tier).observe(
                            time.monotonic() - arrived)
                    if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        # Durable before the caller learns the request is complete.
                        self._spool_usage(progress, _FINISH_STATUS.get(chunk.finish_reason, "OK"))
                        yield chunk
                        return
                    if chunk.text or chunk.token_ids or chunk.logprobs:
                        yield chunk
                raise Unavailable(f"engine {target.endpoint} ended the stream without a"
                                  " finish reason")
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                unreached = code == grpc.StatusCode.UNAVAILABLE and first
                if unreached:
                    # The engine took no work (not reached, or refused): nothing to meter.
                    progress.engine_called = False
                if unreached and attempt + 1 < self._max_attempts:
                    failed.add(target.endpoint)
                    metrics.ENGINE_RETRIES.inc()
                    log.warning("engine_unavailable_retrying", request_id=req.request_id,
                                endpoint=target.endpoint, attempt=attempt + 1)
                    continue
                raise from_rpc_error(e, context=f"engine {target.version}") from None
            finally:
                call.cancel()
                self.router.release(target.endpoint, cost)
        raise Unavailable(f"no engine for model {progress.model!r} answered")

    @staticmethod
    def _chunk(progress: _Progress, target: Target, resp) -> Chunk:
        progress.completion_tokens += len(resp.token_ids)
        metrics.TOKENS_STREAMED.labels(progress.caller.tier).inc(len(resp.token_ids))
        chunk = Chunk(text=resp.text, token_ids=list(resp.token_ids),
                      request_id=progress.req.request_id, logprobs=list(resp.logprobs),
                      finish_reason=resp.finish_reason)
        if resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            progress.cached_tokens = resp.usage.cached_tokens
            progress.finish_reason = finish_reason_name(resp.finish_reason)
            progress.energy_joules = resp.energy_joules
            progress.energy_estimated = resp.energy_estimated
            chunk.prompt_tokens = progress.prompt_tokens
            chunk.completion_tokens = progress.completion_tokens
            chunk.cached_tokens = min(progress.cached_tokens, progress.prompt_tokens)
            chunk.model_version = target.version
        return chunk

    async def count_tokens(self, req: InferenceRequest, timeout: float) -> int:
        model = self.router.resolve_model(self.snapshot, req.model)
        return await self.tokenizer.count(model, req, timeout)
