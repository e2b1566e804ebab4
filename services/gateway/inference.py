"""One request through the pipeline: tokenize, admit, route, stream from an engine, settle.

    async with aclosing(pipeline.stream(caller, request, timeout)) as chunks:
        async for chunk in chunks: ...

Admission reserves prompt + max_tokens before any engine work and is settled when the
request ends, however it ends, to the tokens the usage record bills (nothing when no engine
did any work). Closing the stream early (client cancel, deadline) cancels the engine call,
which frees the request's KV blocks. The usage record is committed to the spool before the
last chunk is handed out, and also written (status CANCELLED or the error code) when the
request ends any other way after an engine took it. No protobuf or grpc here: the engine
client and the adapters convert.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, Protocol

import structlog

from controlplane.snapshot import ConfigSnapshot
from services.gateway import metrics
from services.gateway.admission import check_fits
from services.gateway.auth import Caller
from services.gateway.canary import CanaryGuardian
from services.gateway.degradation import Decision
from services.gateway.downstream import (EngineChunk, EngineClient, EngineFailed, EngineRefused,
                                         FinishReason, TokenizerClient, TokenLogprob)
from services.gateway.health import Failure
from services.gateway.quota_store import QuotaStore
from services.gateway.routing import Router, Target
from services.gateway.tokenizers import Tokenizers
from services.gateway.validation import InferenceRequest, check_context
from services.gateway.version_stats import VersionStats, counts_as_error
from tokenserve.runtime.errors import (DeadlineExceeded, ResourceExhausted, ServiceError,
                                       Unavailable)
from tokenserve.spool import SpoolSender, UsageSpool
from tokenserve.usage import Source, UsageRecord

# Lazy: resolved at first use, after configure_logging (JSON lines).
log = structlog.get_logger(component="inference")


# How an engine-reported finish is written in the usage record's status.
_FINISH_STATUS = {FinishReason.CANCELLED: "CANCELLED", FinishReason.ERROR: "UNKNOWN"}
# Statuses of a request the caller (or its deadline) ended before it finished.
_CANCELLED_STATUSES = frozenset({"CANCELLED", "DEADLINE_EXCEEDED"})
# Least time left worth an engine call: with less, gRPC may fail the call at its deadline
# before the engine's handler runs (measured: 1.5% of calls with 1 ms left, none with 2 ms),
# and the gateway could not tell whether the engine did any work it should bill.
MIN_ENGINE_CALL_S = 0.01


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
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    model_version: str = ""
    # On the first chunk: response metadata (what is left of the tenant's limits after
    # admitting this request, the degradation level).
    metadata: tuple[tuple[str, str], ...] = ()


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
        # An engine took the request (did work): it is billed and metered.
        self.engine_called = False
        self.recorded = False
        # Cut by this gateway's shutdown: ended before it saw the engine's final counts.
        self.cut = False
        self.started_at = time.time()

    def record(self, status: str) -> UsageRecord:
        return UsageRecord(
            event_id=uuid.uuid4().hex, request_id=self.req.request_id, source=Source.GATEWAY,
            tenant_id=self.caller.tenant_id, app=self.req.app, model=self.model,
            model_version=self.version, tier=self.caller.tier,
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            cached_tokens=min(self.cached_tokens, self.prompt_tokens), status=status,
            finish_reason=self.finish_reason,
            cancelled=(status in _CANCELLED_STATUSES or self.finish_reason == "cancelled"
                       or self.cut),
            started_at=self.started_at, finished_at=max(time.time(), self.started_at),
            energy_joules=self.energy_joules, energy_estimated=self.energy_estimated)

    @property
    def billed_tokens(self) -> int:
        """What the request costs the tenant: what its usage record bills."""
        return self.prompt_tokens + self.completion_tokens if self.engine_called else 0


@dataclass
class _Attempt:
    """One engine call of a request; its outcome feeds replica health and version stats."""

    target: Target
    started: float
    first_token_at: float | None = None
    ended: bool = False


class Pipeline:
    def __init__(self, config: ConfigSource, router: Router,
                 tokenizer: TokenizerClient | Tokenizers,
                 engines: EngineClient, quotas: QuotaStore, spool: UsageSpool,
                 sender: SpoolSender | None, *, max_engine_attempts: int = 3,
                 stats: VersionStats | None = None, guardian: CanaryGuardian | None = None,
                 degradation: Callable[[str], Decision] | None = None):
        self._config = config
        # tier -> what the degradation ladder does with its requests now
        self._degradation = degradation or (lambda tier: Decision(0, tier))
        self.router = router
        self.tokenizer = tokenizer
        self._engines = engines
        self._quotas = quotas
        self._spool = spool
        self._sender = sender
        self._max_attempts = max_engine_attempts
        self.stats = stats
        self._guardian = guardian
        # Set as the server drains (SIGTERM): running requests go on, new ones are refused.
        self._draining = False

    def drain(self) -> None:
        self._draining = True

    @property
    def snapshot(self) -> ConfigSnapshot:
        return self._config.snapshot

    async def _spool_usage(self, progress: _Progress, status: str) -> None:
        if progress.recorded:
            return
        progress.recorded = True
        await self._spool.put(progress.record(status))
        metrics.USAGE_EVENTS_SPOOLED.inc()
        if self._sender is not None:
            self._sender.notify()

    async def stream(self, caller: Caller, req: InferenceRequest, timeout: float, *,
                     on_admitted: Callable[[tuple[tuple[str, str], ...]], None] | None = None,
                     ) -> AsyncIterator[Chunk]:
        """`req` must be validated; `timeout` is the seconds left of the caller's deadline.
        The response metadata comes on the first chunk, or, with `on_admitted`, is handed to
        it once the request is admitted, before the engine call (so a gRPC server sends its
        headers while the engine works, not after)."""
        if self._draining:
            raise Unavailable("this gateway is shutting down; retry on another gateway")
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
        # before any tokenizer or engine work: a shed request costs nothing and is not billed
        decision = self._degradation(caller.tier)
        if decision.shed:
            metrics.ADMISSION_REJECTIONS.labels(caller.tier, "degraded").inc()
            raise decision.error()
        metadata = decision.metadata(req.max_tokens)
        req = replace(req, max_tokens=decision.capped(req.max_tokens))
        prompt_ids = await self.tokenizer.encode(model, req, left())
        check_context(len(prompt_ids), req.max_tokens, self.router.max_context(snap, model))
        cost = len(prompt_ids) + req.max_tokens
        check_fits(caller.limits, cost, req.max_tokens)
        try:
            reservation, quota = await self._quotas.admit(caller.tenant_id, caller.limits,
                                                          req.request_id, cost, left())
            if quota is not None:
                metadata = quota.metadata() + metadata
        except ResourceExhausted as e:
            metrics.ADMISSION_REJECTIONS.labels(caller.tier, e.limit or "other").inc()
            raise
        if on_admitted is not None and metadata:
            on_admitted(metadata)
            metadata = ()
        progress = _Progress(caller, req, model, len(prompt_ids))
        status = "UNKNOWN"
        try:
            async with aclosing(self._generate(snap, progress, prompt_ids, left, arrived)) as gen:
                async for chunk in gen:
                    if metadata:
                        chunk.metadata, metadata = metadata, ()
                    yield chunk
            status = "OK"
        except ServiceError as e:
            status = e.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # draining: the server cut the call at the end of its grace period, and the
            # caller sees UNAVAILABLE (a caller's own cancel then is counted the same)
            status = "UNAVAILABLE" if self._draining else "CANCELLED"
            progress.cut = self._draining
            raise
        finally:
            if progress.engine_called:
                await self._spool_usage(progress, status)
            await self._quotas.settle(reservation, progress.billed_tokens)

    async def _generate(self, snap: ConfigSnapshot, progress: _Progress, prompt_ids: list[int],
                        left, arrived: float) -> AsyncIterator[Chunk]:
        caller, req = progress.caller, progress.req
        cost = len(prompt_ids) + req.max_tokens
        failed: set[str] = set()
        refusal: ServiceError | None = None
        # arrival -> the first engine call (tokenizer, admission): part of every attempt's TTFT
        prepared = time.monotonic() - arrived
        for attempt_no in range(self._max_attempts):
            try:
                target = self.router.choose(snap, progress.model, tenant_id=caller.tenant_id,
                                            session_id=req.session_id, prompt_ids=prompt_ids,
                                            exclude=frozenset(failed))
            except Unavailable:
                if refusal is not None:  # every replica refused: say why the last one did
                    raise refusal from None
                raise
            timeout = left()
            if timeout < MIN_ENGINE_CALL_S:
                raise DeadlineExceeded(f"the deadline left {timeout * 1000:.1f} ms, too little"
                                       " to start the engine; nothing was computed or billed")
            self.router.acquire(target.endpoint, cost)
            progress.version = target.version
            progress.engine_called = True
            attempt = _Attempt(target, time.monotonic())
            try:
                async with aclosing(self._engines.generate(
                        target.endpoint, req, prompt_ids, priority=caller.priority,
                        tenant_id=caller.tenant_id, timeout=timeout)) as chunks:
                    async for engine_chunk in chunks:
                        chunk = self._chunk(progress, target.version, engine_chunk)
                        if attempt.first_token_at is None:
                            attempt.first_token_at = time.monotonic()
                            metrics.TIME_TO_FIRST_TOKEN.labels(caller.tier).observe(
                                attempt.first_token_at - arrived)
                        if chunk.finish_reason is FinishReason.CANCELLED:
                            # The engine ended the request itself while this gateway still
                            # listened: its deadline passed there (the engine's clock may
                            # beat the caller's). Not a short OK answer.
                            self._ended(progress, attempt, "DEADLINE_EXCEEDED", prepared)
                            if chunk.token_ids:
                                chunk.finish_reason = None
                                yield chunk
                            raise DeadlineExceeded(f"deadline of {timeout:.3g}s passed; the"
                                                   " engine stopped the request")
                        if chunk.finish_reason is not None:
                            self._ended(progress, attempt, "OK", prepared,
                                        engine_chunk.engine_ttft_s)
                            # Durable before the caller learns the request is complete.
                            await self._spool_usage(
                                progress, _FINISH_STATUS.get(chunk.finish_reason, "OK"))
                            yield chunk
                            return
                        if chunk.text or chunk.token_ids or chunk.logprobs:
                            yield chunk
                raise Unavailable(f"engine {target.endpoint} ended the stream without a"
                                  " finish reason")
            except EngineRefused as e:
                # The engine took no work (not reached, full, or refused the input): not billed.
                progress.engine_called = False
                self._ended(progress, attempt, e.error.code.name, prepared)
                if not e.retryable:
                    raise e.error from None
                refusal = e.error
                failed.add(target.endpoint)
                if attempt_no + 1 < self._max_attempts:
                    metrics.ENGINE_RETRIES.inc()
                    log.warning("engine_refused_retrying", request_id=req.request_id,
                                endpoint=target.endpoint, attempt=attempt_no + 1,
                                code=e.error.code.name)
            except EngineFailed as e:
                self._ended(progress, attempt, e.code, prepared)
                raise e.error from None
            except ServiceError as e:
                self._ended(progress, attempt, e.code.name, prepared)
                raise
            finally:
                self.router.release(target.endpoint, cost)
        raise refusal or Unavailable(f"no engine for model {progress.model!r} answered")

    def _ended(self, progress: _Progress, attempt: _Attempt, code: str, prepared: float,
               engine_ttft: float = 0.0) -> None:
        """An attempt's outcome (the engine's status name) to replica health, the version's
        window and its canary guard. Callers that went away report nothing."""
        if attempt.ended:
            return
        attempt.ended = True
        endpoint, version = attempt.target.endpoint, attempt.target.version
        health = self.router.health
        if health is not None:
            if code == "OK":
                health.on_success(endpoint)
            elif code == "UNAVAILABLE":
                health.on_failure(endpoint, Failure.UNAVAILABLE)
            elif code == "DEADLINE_EXCEEDED" and attempt.first_token_at is None:
                health.on_failure(endpoint, Failure.DEADLINE)
        error = counts_as_error(code)
        if self.stats is None or error is None:
            return
        ttft = added = None
        if not error and attempt.first_token_at is not None:
            ttft = prepared + attempt.first_token_at - attempt.started
            added = max(0.0, ttft - engine_ttft) if engine_ttft > 0 else None
        self.stats.record(progress.model, version, ok=not error, ttft_s=ttft, added_s=added)
        if self._guardian is not None:
            self._guardian.observe(self.snapshot, progress.model)

    @staticmethod
    def _chunk(progress: _Progress, version: str, resp: EngineChunk) -> Chunk:
        progress.completion_tokens += len(resp.token_ids)
        metrics.TOKENS_STREAMED.labels(progress.caller.tier).inc(len(resp.token_ids))
        chunk = Chunk(text=resp.text, token_ids=list(resp.token_ids),
                      request_id=progress.req.request_id, logprobs=resp.logprobs,
                      finish_reason=resp.finish_reason)
        if resp.finish_reason is not None:
            progress.cached_tokens = resp.cached_tokens
            progress.finish_reason = resp.finish_reason.value
            progress.energy_joules = resp.energy_joules
            progress.energy_estimated = resp.energy_estimated
            chunk.prompt_tokens = progress.prompt_tokens
            chunk.completion_tokens = progress.completion_tokens
            chunk.cached_tokens = min(progress.cached_tokens, progress.prompt_tokens)
            chunk.model_version = version
        return chunk

    async def count_tokens(self, req: InferenceRequest, timeout: float) -> int:
        model = self.router.resolve_model(self.snapshot, req.model)
        return await self.tokenizer.count(model, req, timeout)
